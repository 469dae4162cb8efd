"""Zero-shot multiple-choice tasks, scored by log-likelihood.

Two sources. The default is :mod:`qinfer.evals.benchmarks`: published benchmarks (ARC-Easy, PIQA, HellaSwag, ...)
as AllenAI's OLMo evaluations pose them, a context such as ``"Question: ...\nAnswer:"`` and each choice as its
continuation with a leading space; their names are the keys of :data:`qinfer.evals.benchmarks.TASKS`. Any other
name is a BIG-bench JSON task, read from the ``bigbench==1.0.0`` sdist (:mod:`qinfer.evals.bigbench`), which PyPI
no longer serves: a user who has a copy names it with ``bigbench_sdist``.

A BIG-bench prompt is BIG-bench's ``default_format_fn`` at zero shots, with BIG-bench's defaults
``example_input_prefix="\nQ: "``, ``example_output_prefix="\nA: "``, ``choice_prefix="\n  choice: "`` and
``append_choices_to_input=True`` (``bigbench/api/json_task.py``)::

    task_prefix + input_prefix + input [+ choice_prefix + choice_prefix.join(listed choices)] + output_prefix

where the listed choices are ``numpy.random.RandomState(42).permutation(sorted(choices))``, exactly as
BIG-bench lists them. BIG-bench then scores ``prompt + choice``; we move the prompt's trailing spaces onto
the choice instead, as lm-eval-harness does: BPE tokenizers attach a space to the word after it, so
``"A:" + " four"`` is the token sequence a model has seen and ``"A: " + "four"`` is not. Each choice is
therefore stripped and given one leading space, unless the prompt ends in a newline (9 of BIG-bench's
multiple-choice tasks put the answer on a line of its own).

Scoring is BIG-bench's ``multiple_choice_grade``: the model's choice (the highest log-likelihood) earns its
``target_scores`` value, so a question with two right answers ("3" and "three") credits either, and graded
scores (emojis_emotion_prediction) credit in part; a benchmark question's right choice scores 1, the others 0.
Examples are skipped as data noise, not errors, when they have no ``target_scores``, fewer than two choices, a
score outside [0, 1] (BIG-bench 1.0.0 has none), or two choices that are equal once stripped; exact duplicates are
dropped as BIG-bench drops them.
"""

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qinfer.errors import QinferError
from qinfer.evals import benchmarks
from qinfer.evals.bigbench import SUGGESTED, task_json

# BIG-bench's defaults (bigbench/api/json_task.py, JsonTask.load_and_process_json)
_DEFAULT_INPUT_PREFIX = "\nQ: "
_DEFAULT_OUTPUT_PREFIX = "\nA: "
_DEFAULT_CHOICE_PREFIX = "\n  choice: "
_BIGBENCH_SEED = 42  # JsonTask's default random_seed: the choice listing order and max_examples sampling


@dataclass(frozen=True)
class MCExample:
    """One question: score ``context + choices[i]`` for each ``i``; choosing ``choices[i]`` earns ``scores[i]``
    (BIG-bench's ``target_scores``: 1 for a right answer, 0 for a wrong one, between them for a graded one)."""

    context: str
    choices: tuple[str, ...]
    scores: tuple[float, ...]

    def __post_init__(self):
        if not isinstance(self.context, str):
            raise QinferError(f"MCExample.context must be a str; got {type(self.context).__name__}")
        if not isinstance(self.choices, tuple) or not all(isinstance(c, str) and c for c in self.choices):
            raise QinferError(f"MCExample.choices must be a tuple of non-empty str; got {self.choices!r}")
        if len(self.choices) < 2 or len(set(self.choices)) != len(self.choices):
            raise QinferError(f"MCExample needs at least two distinct choices; got {self.choices!r}")
        if (not isinstance(self.scores, tuple) or len(self.scores) != len(self.choices)
                or not all(type(v) in (int, float) and 0 <= v <= 1 for v in self.scores)):
            n = len(self.choices)
            raise QinferError(f"MCExample.scores must be a tuple of {n} numbers in [0, 1], one per choice; "
                              f"got {self.scores!r}")


@dataclass(frozen=True)
class MCResult:
    """``accuracy``: the mean score of the choice with the highest total log-likelihood (BIG-bench's
    ``multiple_choice_grade``). ``accuracy_norm``: the same for the choice with the highest log-likelihood per
    character of the continuation (leading space included), which does not favour short answers and does not depend
    on the tokenizer, so it compares across model families; it is lm-eval-harness's ``acc_norm`` up to that one
    space, and to a newline the prompt ends with, which is context here (see :func:`continuation_loglik`) where
    lm-eval scores it with each choice. Exact ties (a bf16 model's logits can tie) earn the mean score of the tied
    choices. ``n`` examples were scored. ``accuracy_se`` and ``accuracy_norm_se`` are standard errors of the mean
    over the examples (NaN for one example). All four are NaN for a model that produced NaN."""

    accuracy: float
    accuracy_norm: float
    n: int
    accuracy_se: float
    accuracy_norm_se: float

    def __post_init__(self):
        if type(self.n) is not int or self.n < 1:
            raise QinferError(f"MCResult.n must be a positive int; got {self.n!r}")
        for field in ("accuracy", "accuracy_norm", "accuracy_se", "accuracy_norm_se"):
            value = getattr(self, field)
            if not (0.0 <= value <= 1.0 or math.isnan(value)):  # NaN: a model that produced NaN
                raise QinferError(f"MCResult.{field} must be in [0, 1] or NaN; got {value!r}")


def load_task(name: str, limit: int | None = None, bigbench_sdist: Path | None = None) -> list[MCExample]:
    """The zero-shot examples of task ``name``: a benchmark of :data:`qinfer.evals.benchmarks.TASKS`, else a
    BIG-bench task (``"task"`` or ``"task:subtask"``) read from ``bigbench_sdist`` or the cached sdist.

    Examples come in a fixed pseudo-random order, ``RandomState(42).permutation`` of the distinct examples, and
    ``limit`` keeps the first ``limit`` usable ones, so a small limit samples the whole task rather than its first
    section, and ``limit=n`` is a prefix of ``limit=n + 1``. For a BIG-bench task without subtasks and without
    skipped examples this is the very sample, in the same order, that BIG-bench's own ``max_examples`` draws. A
    BIG-bench container task yields the examples of all its subtasks (in subtask-folder order, each formatted with
    its own prefixes); ``"task:subtask"`` names one subtask by its folder.
    """
    if limit is not None and (type(limit) is not int or limit < 1):
        raise QinferError(f"limit must be a positive integer or None; got {limit!r}")
    examples = _benchmark_examples(name) if name in benchmarks.TASKS else _bigbench_examples(name, bigbench_sdist)
    order = np.random.RandomState(_BIGBENCH_SEED).permutation(len(examples))
    chosen = [examples[i] for i in order if examples[i] is not None]
    return chosen[:limit] if limit is not None else chosen


def _benchmark_examples(name: str) -> list[MCExample | None]:
    examples: list[MCExample | None] = []
    for context, choices, right in benchmarks.questions(name):
        if len(set(choices)) != len(choices):  # two equal choices: data noise, as in BIG-bench
            examples.append(None)
            continue
        scores = tuple(1.0 if i == right else 0.0 for i in range(len(choices)))
        examples.append(MCExample(context=context, choices=choices, scores=scores))
    return examples


def _bigbench_examples(name: str, sdist: Path | None) -> list[MCExample | None]:
    task, colon, subtask = name.partition(":")
    if colon and not subtask:
        raise QinferError(f"BIG-bench task name {name!r} ends in ':' without a subtask: name one after it, or drop "
                          "the ':'")
    data = task_json(task, sdist)
    parts = _select_subtasks(name, task, subtask, data)
    examples: list[MCExample | None] = []
    for part in parts:
        examples.extend(_format_examples(part))
    if not any(examples):
        raise QinferError(
            f"BIG-bench task {name} has no usable multiple-choice examples (none has target_scores for two or "
            f"more choices); qinfer scores multiple-choice tasks only, e.g. {', '.join(SUGGESTED)}"
        )
    return examples


def score_mc(
    examples: Sequence[MCExample], loglik: Callable[[str, list[str]], list[tuple[float, int]]]
) -> MCResult:
    """Score ``examples`` with ``loglik(context, continuations) -> [(sum of log-probs, n tokens), ...]``.

    A tie for the best log-likelihood earns the mean score of the tied choices, the expected score of breaking
    the tie at random: a model that cannot tell choices apart (constant logits, a quantization gone wrong) then
    scores chance, where "first index wins" (BIG-bench's argmax) would score however often the answer sits
    first. A NaN log-likelihood (a broken model) makes both accuracies NaN, as it
    makes the model's perplexity: reported as such, not a silently wrong number, and scoring stops there.
    """
    if not examples:
        raise QinferError("score_mc got no examples; load a task with load_task() first")
    credits, credits_norm = [], []
    for i, ex in enumerate(examples):
        scores = loglik(ex.context, list(ex.choices))
        if len(scores) != len(ex.choices):
            raise QinferError(f"loglik returned {len(scores)} scores for {len(ex.choices)} choices (example {i})")
        lls = [float(ll) for ll, _ in scores]
        if any(int(n) < 1 for _, n in scores):
            raise QinferError(f"example {i}: loglik returned {scores}; a choice scored no tokens")
        if any(math.isnan(ll) for ll in lls):
            nan = math.nan
            return MCResult(accuracy=nan, accuracy_norm=nan, n=len(examples), accuracy_se=nan, accuracy_norm_se=nan)
        credits.append(_credit(lls, ex.scores))
        credits_norm.append(_credit([ll / len(choice) for ll, choice in zip(lls, ex.choices)], ex.scores))
    (acc, se), (acc_norm, se_norm) = _mean_and_se(credits), _mean_and_se(credits_norm)
    return MCResult(accuracy=acc, accuracy_norm=acc_norm, n=len(examples), accuracy_se=se, accuracy_norm_se=se_norm)


@torch.no_grad()
def continuation_loglik(
    forward: Callable[[torch.Tensor], torch.Tensor],
    tokenizer_encode: Callable[[str], list[int]],
    context: str,
    continuations: Sequence[str],
    batch_size: int = 1,
    max_tokens: int | None = None,
) -> list[tuple[float, int]]:
    """``[(log p(continuation | context), n continuation tokens)]`` for each continuation.

    Tokenized as lm-eval-harness does: trailing whitespace of ``context`` moves onto the continuation (a
    tokenizer may merge it with what follows, " " + "Paris" as " Paris", or with whitespace before it, GPT-2's
    BPE ": \n" at the end of a text but not before a word), ``tokenizer_encode`` (which adds BOS) encodes
    ``context`` and ``context + continuation``, and the tokens past the context's count are the continuation.
    Encoding the two halves apart would score a token split the model never sees at the boundary. Where the
    moved whitespace still encodes as tokens of its own that every continuation starts with (a newline before
    each answer), those tokens are context again: their log-probability, the same for every choice, would
    otherwise weigh on a per-character score.

    ``forward(ids [B, T]) -> logits [B, T, V]`` is a causal LM. With ``batch_size`` > 1 several continuations
    run as one right-padded batch: causal attention never looks right, so padding cannot change the logits
    of real positions (the forward must then accept B > 1; ``batch_size=1`` needs only B = 1). Instead of a tensor,
    ``forward`` may return an object whose ``select([(b, positions), ...])`` gives those rows' logits
    (:class:`qinfer.evals.forward.LazyLogits`, which runs the lm_head on them only, in one call).

    ``max_tokens`` (the model's context): a longer row loses context tokens from the left, after the first (a
    BOS stays where it is), as lm-eval-harness truncates; a continuation that does not fit is an error.
    """
    if type(batch_size) is not int or batch_size < 1:
        raise QinferError(f"batch_size must be a positive int; got {batch_size!r}")
    spaces = len(context) - len(context.rstrip())
    moved = context[len(context) - spaces:]
    if spaces:
        context, continuations = context[:-spaces], [moved + c for c in continuations]
    n_context = len(tokenizer_encode(context))
    if n_context == 0:  # nothing to condition the first continuation token on
        raise QinferError("the context encodes to no tokens; tokenizer_encode must add BOS, or pass a context")
    rows = []
    for cont in continuations:
        ids = tokenizer_encode(context + cont)
        if len(ids) <= n_context:
            raise QinferError(f"continuation {cont!r} adds no tokens after the context; it cannot be scored")
        rows.append(ids)
    if moved:
        kept = tokenizer_encode(context + moved)
        if all(len(row) > len(kept) and row[: len(kept)] == kept for row in rows):
            n_context = len(kept)
    longest = max(len(row) for row in rows)
    cut = 0 if max_tokens is None else longest - max_tokens
    if cut > 0:
        if cut > n_context - 2:  # the first token and one of context stay
            raise QinferError(f"a continuation of {longest - n_context} tokens does not fit the model's context of "
                              f"{max_tokens} tokens")
        rows, n_context = [row[:1] + row[1 + cut :] for row in rows], n_context - cut
    out = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        T = max(len(ids) for ids in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)  # pad id 0: only ever to the right of real tokens
        for b, row in enumerate(batch):
            ids[b, : len(row)] = torch.tensor(row)
        logits = forward(ids)  # [B, T, V]
        # logits at position p predict token p + 1: continuation tokens n_context.. come from n_context - 1..
        spans = [(b, slice(n_context - 1, len(row) - 1)) for b, row in enumerate(batch)]
        picked = [logits[b, s] for b, s in spans] if isinstance(logits, torch.Tensor) else logits.select(spans)
        for row, rows_logits in zip(batch, picked):
            lp = torch.log_softmax(rows_logits.float(), dim=-1)
            target = torch.tensor(row[n_context:])
            out.append((float(lp.gather(-1, target[:, None]).double().sum()), len(row) - n_context))
    return out


def _credit(values: list[float], scores: tuple[float, ...]) -> float:
    best = [i for i, v in enumerate(values) if v == max(values)]
    return sum(scores[i] for i in best) / len(best)


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (sample standard deviation / sqrt(n); NaN for n = 1)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _select_subtasks(name: str, task: str, subtask: str, data: dict) -> list[dict]:
    subtasks = data.get("subtasks")
    if subtask:
        if not subtasks:
            raise QinferError(f"BIG-bench task {task} has no subtasks; name it as {task}")
        if subtask not in subtasks:
            names = ", ".join(f"{task}:{s}" for s in sorted(subtasks))
            raise QinferError(f"BIG-bench task {task} has no subtask {subtask!r}; use one of {names}")
        return [subtasks[subtask]]
    if not subtasks:
        return [data]
    generative = [s for s, part in sorted(subtasks.items()) if not _is_multiple_choice(part)]
    if generative:
        mc = [f"{task}:{s}" for s, part in sorted(subtasks.items()) if _is_multiple_choice(part)]
        if not mc:
            return []  # reported by the caller as "no multiple-choice examples"
        raise QinferError(
            f"BIG-bench task {name} mixes multiple-choice and generative subtasks ({', '.join(generative)}); "
            f"name a multiple-choice one: {', '.join(mc)}"
        )
    return [subtasks[s] for s in sorted(subtasks)]


def _is_multiple_choice(data: dict) -> bool:
    return any(isinstance(ex, dict) and "target_scores" in ex for ex in data.get("examples", []))


def _format_examples(data: dict) -> list[MCExample | None]:
    """One entry per distinct example, ``None`` for skipped ones (they keep their place in the order)."""
    task_prefix = str(data.get("task_prefix", ""))
    input_prefix = data.get("example_input_prefix", _DEFAULT_INPUT_PREFIX)
    output_prefix = data.get("example_output_prefix", _DEFAULT_OUTPUT_PREFIX)
    choice_prefix = data.get("choice_prefix", _DEFAULT_CHOICE_PREFIX)
    append_choices = data.get("append_choices_to_input", True)
    seen: set[str] = set()
    out: list[MCExample | None] = []
    for ex in data.get("examples", []):
        key = json.dumps(ex)
        if key in seen:
            continue
        seen.add(key)
        out.append(_format_example(ex, task_prefix, input_prefix, output_prefix, choice_prefix, append_choices))
    return out


def _format_example(ex, task_prefix, input_prefix, output_prefix, choice_prefix, append_choices) -> MCExample | None:
    scores = ex.get("target_scores") if isinstance(ex, dict) else None
    if not isinstance(scores, dict) or len(scores) < 2 or not isinstance(ex.get("input"), str):
        return None
    if not all(type(v) in (int, float) and 0 <= v <= 1 for v in scores.values()):
        return None
    # A fresh RandomState per example, as in BIG-bench: the order depends only on the number of choices.
    # The choices keep this order in MCExample too: authors often list the right answer first, and a model
    # that cannot tell the choices apart must not profit from that.
    keys = sorted(scores)
    listed = [keys[i] for i in np.random.RandomState(_BIGBENCH_SEED).permutation(len(keys))]
    text = ex["input"]
    if append_choices:
        text = text + choice_prefix + choice_prefix.join(listed)
    context = (task_prefix + input_prefix + text + output_prefix).rstrip(" ")
    sep = "" if not context or context.endswith("\n") else " "
    choices = tuple(sep + choice.strip() for choice in listed)
    if len(set(choices)) != len(choices) or any(not c.strip() for c in choices):
        return None
    return MCExample(context=context, choices=choices, scores=tuple(scores[key] for key in listed))


