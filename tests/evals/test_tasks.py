import hashlib
import io
import json
import math
import shutil
import tarfile

import numpy as np
import pytest
import torch

from qinfer.errors import QinferError
from qinfer.evals import bigbench
from qinfer.evals.tasks import MCExample, continuation_loglik, load_task, score_mc

ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"


def _task(name, examples, **fields):
    return {"canary": "x", "name": name, "description": "d", "keywords": ["k"], "metrics": ["multiple_choice_grade"],
            "preferred_score": "multiple_choice_grade", "examples": examples, **fields}


NUMBERED = [{"input": f"question {i}", "target_scores": {f"right {i}": 1, f"wrong {i}": 0}} for i in range(40)]
FILES = {
    "legs/task.json": _task("legs", [
        {"input": "How many legs does an insect have?", "target_scores": {"six": 1, "four": 0, "two": 0, "eight": 0}},
        {"input": "Two right?", "target_scores": {"3": 1, "three": 1, "4": 0}},  # kept: either earns 1
        {"input": "Graded?", "target_scores": {"joy": 0.75, "fear": 0.25, "anger": 0}},  # kept: partial credit
        {"input": "Out of range?", "target_scores": {"a": 2, "b": 0}},  # skipped: a score above 1
        {"input": "One choice?", "target_scores": {"yes": 1}},  # skipped: nothing to choose between
        {"input": "Free text?", "target": "no choices"},  # skipped: generative
        {"input": "Equal once stripped?", "target_scores": {"yes": 1, " yes ": 0}},  # skipped
        {"input": "Cats?", "target_scores": {"four": 1, "two": 0}},
        {"input": "Cats?", "target_scores": {"four": 1, "two": 0}},  # exact duplicate: dropped
    ]),
    "reasoning/task.json": _task("reasoning", [
        {"input": "The 'he' refers to Bob.", "target_scores": {"correct": 0, "incorrect": 1}},
    ], task_prefix="Judge the reasoning.\n", example_input_prefix="\n",
        example_output_prefix="\nThe above reasoning is ", append_choices_to_input=False),
    "newline_answer/task.json": _task("newline_answer", [
        {"input": "Pick a colour", "target_scores": {" red": 1, "blue ": 0}},
    ], example_output_prefix="\nAnswer:\n", append_choices_to_input=False),
    "numbered/task.json": _task("numbered", NUMBERED, append_choices_to_input=False),
    "generative/task.json": _task("generative", [{"input": "2+2=", "target": "4"}], metrics=["exact_str_match"]),
    "box/task.json": {"canary": "x", "name": "box", "description": "d", "keywords": ["k"]},
    "box/small/task.json": _task("box_small", [{"input": "s", "target_scores": {"x": 1, "y": 0}}],
                                 example_input_prefix="S: "),
    "box/large/task.json": _task("box_large", [{"input": "l", "target_scores": {"x": 0, "y": 1}}]),
    "mixed/task.json": {"canary": "x", "name": "mixed", "description": "d", "keywords": ["k"]},
    "mixed/choose/task.json": _task("mixed_choose", [{"input": "c", "target_scores": {"x": 1, "y": 0}}]),
    "mixed/write/task.json": _task("mixed_write", [{"input": "w", "target": "t"}], metrics=["bleu"]),
}


def _sdist_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        members = {"bigbench-1.0.0/setup.py": b"# not used\n", ROOT + "programmatic/task.py": b"# no task.json\n"}
        members.update({ROOT + path: json.dumps(data).encode() for path, data in FILES.items()})
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def sdist(tmp_path, monkeypatch):
    """A tiny fake bigbench sdist in a fresh cache, accepted by the sha256 check."""
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    blob = _sdist_bytes()
    monkeypatch.setattr(bigbench, "SDIST_SHA256", hashlib.sha256(blob).hexdigest())
    path = bigbench.data_dir() / bigbench.SDIST  # (the folder made)
    path.write_bytes(blob)
    return path


def test_default_prefixes_list_choices_in_bigbench_order(sdist):
    ex = load_task("legs")
    assert len(ex) == 4  # the score of 2, the lone choice, the generative, the strip clash and the duplicate are out
    insect = next(e for e in ex if "insect" in e.context)
    # BIG-bench lists RandomState(42).permutation(sorted choices): [1, 3, 0, 2] of (eight, four, six, two)
    assert insect == MCExample(
        context="\nQ: How many legs does an insect have?\n  choice: four\n  choice: two\n  choice: eight\n"
        "  choice: six\nA:",
        choices=(" four", " two", " eight", " six"),
        scores=(0, 0, 0, 1),
    )
    listed = np.random.RandomState(42).permutation(sorted(["six", "four", "two", "eight"]))  # BIG-bench's own line
    assert [c.strip() for c in insect.choices] == list(listed)
    # each choice keeps its own target score: two right answers, or graded ones
    two = next(e for e in ex if "Two right" in e.context)
    assert dict(zip(two.choices, two.scores)) == {" 3": 1, " three": 1, " 4": 0}
    graded = next(e for e in ex if "Graded" in e.context)
    assert dict(zip(graded.choices, graded.scores)) == {" joy": 0.75, " fear": 0.25, " anger": 0}


def test_task_prefix_and_custom_prefixes(sdist):
    (ex,) = load_task("reasoning")
    assert ex.context == "Judge the reasoning.\n\nThe 'he' refers to Bob.\nThe above reasoning is"
    assert ex.choices == (" incorrect", " correct") and ex.scores == (1, 0)


def test_answer_on_its_own_line_gets_no_leading_space(sdist):
    (ex,) = load_task("newline_answer")
    assert ex.context == "\nQ: Pick a colour\nAnswer:\n"
    assert ex.choices == ("blue", "red") and ex.scores == (0, 1)


def test_limit_is_a_fixed_sample_of_the_whole_task(sdist):
    full = load_task("numbered")
    assert len(full) == 40 and sorted(e.context for e in full) == sorted(f"\nQ: question {i}\nA:" for i in range(40))
    assert load_task("numbered", limit=5) == full[:5] == load_task("numbered", limit=5)
    # the sample BIG-bench's max_examples=5 draws (rng.choice without replacement), in the same order
    picked = np.random.RandomState(42).choice(40, 5, replace=False)
    assert [e.context for e in full[:5]] == [f"\nQ: question {i}\nA:" for i in picked]
    assert [e.context for e in full[:5]] != [f"\nQ: question {i}\nA:" for i in range(5)]
    assert load_task("numbered", limit=1000) == full
    with pytest.raises(QinferError, match="limit"):
        load_task("numbered", limit=0)


def test_container_task_and_one_subtask(sdist):
    both = load_task("box")
    listed = "\n  choice: y\n  choice: x\nA:"  # each subtask formatted with its own prefixes
    assert sorted(e.context for e in both) == ["\nQ: l" + listed, "S: s" + listed]
    (small,) = load_task("box:small")
    assert small.context == "S: s" + listed and small.choices == (" y", " x") and small.scores == (0, 1)
    with pytest.raises(QinferError, match="box:large, box:small"):
        load_task("box:medium")
    with pytest.raises(QinferError, match="has no subtasks"):
        load_task("legs:small")
    with pytest.raises(QinferError, match="'box:' ends in ':' without a subtask"):
        load_task("box:")


def test_mixed_container_names_its_multiple_choice_subtasks(sdist):
    with pytest.raises(QinferError, match=r"mixes .* \(write\); name a multiple-choice one: mixed:choose"):
        load_task("mixed")
    assert len(load_task("mixed:choose")) == 1


def test_generative_task_is_a_clear_error(sdist):
    with pytest.raises(QinferError, match="no usable multiple-choice examples"):
        load_task("generative")


def test_unknown_task_lists_valid_names(sdist):
    with pytest.raises(QinferError, match=r"unknown BIG-bench task 'numberd'.*did you mean numbered"):
        load_task("numberd")
    with pytest.raises(QinferError, match="unknown BIG-bench task 'programmatic'.*e.g. general_knowledge"):
        load_task("programmatic")
    with pytest.raises(QinferError, match="not a BIG-bench task name"):
        load_task("../legs")
    index = json.loads((bigbench.data_dir() / "index.json").read_text())
    assert index["box"] == ["large", "small"] and index["legs"] == [] and "programmatic" not in index
    sdist.unlink()  # the index answers without the sdist
    with pytest.raises(QinferError, match="unknown BIG-bench task"):
        load_task("nope")
    shutil.rmtree(bigbench.data_dir() / "tasks", ignore_errors=True)
    (bigbench.data_dir() / "index.json").unlink()
    with pytest.raises(QinferError, match=r"unknown task 'nope': qinfer's tasks are arc_easy, .*PyPI no longer "
                                          r"serves \(no BIG-bench sdist is at hand; pass --bigbench-sdist FILE"):
        load_task("nope")


def test_tasks_are_cached_and_read_without_the_sdist(sdist):
    first = load_task("legs")
    cached = json.loads((bigbench.data_dir() / "tasks" / "legs.json").read_text())
    assert cached == FILES["legs/task.json"]
    sdist.unlink()
    assert load_task("legs") == first


def test_a_changed_sdist_is_rejected(sdist, monkeypatch):
    monkeypatch.setattr(bigbench, "SDIST_SHA256", "0" * 64)
    with pytest.raises(QinferError, match="not bigbench 1.0.0's"):
        load_task("legs")


def test_an_sdist_elsewhere_is_named_with_bigbench_sdist(sdist, tmp_path):
    elsewhere = tmp_path / "copies" / bigbench.SDIST
    elsewhere.parent.mkdir()
    sdist.rename(elsewhere)
    with pytest.raises(QinferError, match=r"--bigbench-sdist FILE or copy it to"):
        load_task("legs")
    with pytest.raises(QinferError, match=r"--bigbench-sdist .*nowhere.tar.gz: no such file"):
        load_task("legs", bigbench_sdist=tmp_path / "nowhere.tar.gz")
    assert len(load_task("legs", bigbench_sdist=elsewhere)) == 4
    assert not sdist.exists()  # read where it is, not copied


def _example(answer, *choices):
    """One right choice, ``choices[answer]``."""
    return MCExample(context="Q:", choices=tuple(choices), scores=tuple(int(i == answer) for i in range(len(choices))))


def test_accuracy_and_per_character_accuracy_differ_as_expected():
    # A fixed cost per continuation plus a small one per character: the total favours short choices,
    # the per-character score favours long ones.
    def loglik(context, continuations):
        return [(-2.0 - 0.1 * len(c), max(1, len(c) // 3)) for c in continuations]

    examples = [_example(1, " no", " absolutely"), _example(0, " wonderful", " ok"), _example(0, " a", " bbbbbb")]
    result = score_mc(examples, loglik)
    assert result.n == 3
    assert result.accuracy == pytest.approx(1 / 3)  # only the short right answer
    assert result.accuracy_norm == pytest.approx(2 / 3)  # only the long right answers
    # standard errors of the mean over the three examples: credits (0, 0, 1) and (1, 1, 0)
    assert result.accuracy_se == result.accuracy_norm_se == pytest.approx(1 / 3)  # sqrt((2/3) / 2 / 3)


def test_a_choice_earns_its_target_score():
    # BIG-bench's multiple_choice_grade: the chosen continuation's score, so either of two right answers earns 1
    # and a graded one its part; tied best choices earn their mean
    examples = [MCExample("Q:", (" 3", " three", " 4"), (1, 1, 0)), MCExample("Q:", (" joy", " fear"), (0.75, 0.25))]

    def loglik(best):
        return lambda context, conts: [(-1.0 if c in best else -5.0, 1) for c in conts]

    assert score_mc(examples, loglik({" 3", " fear"})).accuracy == pytest.approx((1 + 0.25) / 2)
    assert score_mc(examples, loglik({" three", " joy"})).accuracy == pytest.approx((1 + 0.75) / 2)
    assert score_mc(examples, loglik({" 4", " joy", " fear"})).accuracy == pytest.approx((0 + 0.5) / 2)
    one = score_mc(examples[:1], loglik({" 4"}))
    assert one.accuracy == 0 and math.isnan(one.accuracy_se)  # no spread from one example


def test_ties_earn_chance_credit():
    examples = [_example(0, " a", " b"), _example(2, " a", " b", " c"), _example(1, " a", " b", " c", " d")]
    result = score_mc(examples, lambda context, conts: [(-1.0, 1)] * len(conts))
    assert result.accuracy == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert result.accuracy_norm == pytest.approx(result.accuracy)  # " a" .. " d" have equal lengths


def test_score_mc_reports_nan_and_rejects_wrong_counts():
    # a model producing NaN gets NaN accuracy (as its perplexity is NaN), not an error that stops the whole eval
    nan = score_mc([_example(0, " a", " b")] * 3, lambda c, conts: [(float("nan"), 1), (-1.0, 1)])
    assert math.isnan(nan.accuracy) and math.isnan(nan.accuracy_norm) and math.isnan(nan.accuracy_se) and nan.n == 3
    with pytest.raises(QinferError, match="scored no tokens"):
        score_mc([_example(0, " a", " b")], lambda c, conts: [(-1.0, 0), (-1.0, 1)])
    with pytest.raises(QinferError, match="1 scores for 2 choices"):
        score_mc([_example(0, " a", " b")], lambda c, conts: [(-1.0, 1)])
    with pytest.raises(QinferError, match="no examples"):
        score_mc([], lambda c, conts: [])


def test_mc_example_is_validated():
    for scores in [(1,), (1, 0, 0), (2, 0), (-0.5, 1), (1, None), (True, False)]:
        with pytest.raises(QinferError, match=r"scores must be a tuple of 2 numbers in \[0, 1\]"):
            MCExample("Q:", (" a", " b"), scores)
    with pytest.raises(QinferError, match="two distinct"):
        _example(0, " a", " a")


# A word-level tokenizer that, like GPT-2's BPE, attaches a space to the word after it; id 1 is BOS.
_WORDS = ["<pad>", "<bos>", "Q:", " hi", "\n", "A:", " yes", " no", " way", " ", "yes"]


def _encode(text):
    ids, i = [1], 0
    while i < len(text):
        word = max((w for w in _WORDS[2:] if text.startswith(w, i)), key=len)
        ids.append(_WORDS.index(word))
        i += len(word)
    return ids


V = len(_WORDS)
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(1))
BIAS = torch.randn(3, V, generator=torch.Generator().manual_seed(2))


def _causal_model(ids):
    """logits[b, t] depend on token t and on the sum of tokens 0..t: causal, and not a bigram."""
    return TABLE[ids] + BIAS[ids.cumsum(dim=1) % 3]


def _reference(ids, start):
    """log p(ids[start:] | ids[:start]) computed one position at a time on the unpadded sequence."""
    total = 0.0
    for t in range(start, len(ids)):
        logits = TABLE[ids[t - 1]] + BIAS[sum(ids[:t]) % 3]
        total += float(torch.log_softmax(logits.double(), dim=-1)[ids[t]])
    return total


def test_continuation_loglik_matches_a_hand_computed_model():
    out = continuation_loglik(_causal_model, _encode, "Q: hi\nA:", [" yes", " no way"])
    ctx = _encode("Q: hi\nA:")
    assert [n for _, n in out] == [1, 2]
    assert out[0][0] == pytest.approx(_reference(ctx + [_WORDS.index(" yes")], len(ctx)), abs=1e-5)
    assert out[1][0] == pytest.approx(_reference(ctx + [7, 8], len(ctx)), abs=1e-5)


def test_trailing_space_moves_onto_the_continuation():
    # "A: " + "yes" would otherwise be scored as the tokens " " "yes", which the model never sees.
    moved = continuation_loglik(_causal_model, _encode, "Q: hi\nA: ", ["yes", "no way"])
    assert moved == continuation_loglik(_causal_model, _encode, "Q: hi\nA:", [" yes", " no way"])


def test_a_trailing_newline_that_stays_a_token_of_its_own_is_context():
    # moved onto the continuation (a tokenizer may merge it with whitespace before it only at the end of a text),
    # then, as every choice starts with it as its own token, context again: scored for no choice
    out = continuation_loglik(_causal_model, _encode, "Q: hi\n", ["yes", "A:"])
    ctx = _encode("Q: hi\n")
    assert [n for _, n in out] == [1, 1]
    assert out[0][0] == pytest.approx(_reference(ctx + [_WORDS.index("yes")], len(ctx)), abs=1e-5)
    assert out[1][0] == pytest.approx(_reference(ctx + [_WORDS.index("A:")], len(ctx)), abs=1e-5)


def test_a_context_past_the_models_window_loses_its_oldest_tokens():
    # BIG-bench's which_wiki_edit runs to 119k tokens: the context keeps its first token (BOS) and its last ones
    long = "Q:" + " hi" * 20 + "\nA:"
    out = continuation_loglik(_causal_model, _encode, long, [" yes", " no way"], max_tokens=8)
    ids = _encode(long)
    kept = ids[:1] + ids[len(ids) - 5:]  # 8 positions for the longer choice's 2 tokens and 6 of context
    assert [n for _, n in out] == [1, 2]
    assert out[1][0] == pytest.approx(_reference(kept + [7, 8], len(kept)), abs=1e-5)
    assert out[0][0] == pytest.approx(_reference(kept + [6], len(kept)), abs=1e-5)
    with pytest.raises(QinferError, match="a continuation of 2 tokens does not fit the model's context of 3"):
        continuation_loglik(_causal_model, _encode, long, [" yes", " no way"], max_tokens=3)


def test_right_padded_batches_give_the_same_scores():
    conts = [" yes", " no way", " no", " yes no way"]
    one = continuation_loglik(_causal_model, _encode, "Q: hi\nA:", conts)
    batched = continuation_loglik(_causal_model, _encode, "Q: hi\nA:", conts, batch_size=3)
    assert [n for _, n in batched] == [n for _, n in one]
    assert [ll for ll, _ in batched] == pytest.approx([ll for ll, _ in one], abs=1e-5)


def test_empty_context_needs_a_bos_token():
    assert continuation_loglik(_causal_model, _encode, "", ["Q:"])[0][1] == 1  # BOS conditions the first token
    with pytest.raises(QinferError, match="must add BOS"):
        continuation_loglik(_causal_model, lambda text: _encode(text)[1:], "", ["Q:"])


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp8"])
def test_a_choice_scores_the_same_whatever_choices_run_beside_it(tmp_path, monkeypatch, kv):
    # a choice's log-likelihood must not move with the other choices and padding in its batch (it did when a
    # quantized cache without stored scales took them from its first write, the whole batch)
    import qinfer.evals.accuracy as accuracy
    from qinfer.evals.tasks import MCExample
    from qinfer.model.loader import load_model
    from qinfer.sources.tokenizer import Tokenizer
    from tests.evals.eval_fixtures import tiny_model

    folder = tiny_model(tmp_path / "m", "llama")
    model, tok = load_model(folder, dtype=torch.float32), Tokenizer.from_folder(folder)
    scores = []
    real = accuracy.continuation_loglik
    monkeypatch.setattr(accuracy, "continuation_loglik", lambda *a, **k: scores.append(real(*a, **k)) or scores[-1])
    examples = [MCExample("It is a truth", (" universally", " a"), (1, 0)),
                MCExample("It is a truth", (" universally", " acknowledged, that a single man in possession"), (1, 0))]
    accuracy.task_accuracy(model, tok, examples, kv, "t", progress=False)
    # to fp32 rounding (a longer padded batch runs the matmuls in other blocks), and the same token count
    assert scores[0][0] == (pytest.approx(scores[1][0][0], rel=1e-6, abs=0), scores[1][0][1])


def test_an_empty_prompt_is_scored_after_an_end_of_text_where_the_model_adds_no_bos(tmp_path):
    # BIG-bench's cause_and_effect one_sentence_no_prompt: no input, no prefix; SmolLM2 and Qwen add no BOS
    import qinfer.evals.accuracy as accuracy
    from qinfer.evals.tasks import MCExample
    from qinfer.model.loader import load_model
    from qinfer.sources.tokenizer import Tokenizer
    from tests.evals.eval_fixtures import tiny_model

    folder = tiny_model(tmp_path / "m", "llama")
    model, tok = load_model(folder, dtype=torch.float32), Tokenizer.from_folder(folder)
    tok.add_bos_token = False
    assert tok.encode("") == [] and tok.eos_ids
    example = MCExample("", ("It is a truth", "a single man"), (1, 0))
    result = accuracy.task_accuracy(model, tok, [example], "bf16", "t", progress=False)
    assert result.n == 1 and result.accuracy in (0.0, 1.0)
