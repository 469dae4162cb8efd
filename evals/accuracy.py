"""What a model is judged on: the evaluation text (as tokens) and zero-shot BIG-bench task accuracy.

The text is the held-out Austen novel (*Persuasion*, never used for calibration, see
:mod:`qinfer.calib.austen`) or a UTF-8 file, cut to its first ``max_tokens`` tokens so that a default
eval stays quick on a CPU. Task accuracy is :func:`qinfer.evals.tasks.score_mc` over
:func:`qinfer.evals.tasks.continuation_loglik`, the choices of one question run as one batch.
"""

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from qinfer.calib.austen import HELDOUT_BOOK, heldout_text
from qinfer.errors import QinferError
from qinfer.evals.forward import batch_forward
from qinfer.evals.tasks import MCExample, MCResult, continuation_loglik, score_mc
from qinfer.model.decoder import Transformer
from qinfer.sources.tokenizer import Tokenizer

HELDOUT = "heldout"
_CHOICE_BATCH = 16  # choices scored in one forward: every question's choices at once
_CHARS_PER_TOKEN = 8  # a generous first guess of how much text yields the tokens asked for
_MARGIN = 16  # tokens dropped at the cut of a prefix: a token split there may differ in the full text


def load_text(spec: str) -> tuple[str, str]:
    """``(text, description)`` for ``--text``: "heldout" or the path of a UTF-8 text file."""
    if spec == HELDOUT:
        if Path(HELDOUT).exists():
            print(f"note: --text {HELDOUT} is the held-out novel; the {HELDOUT} here is not read (write ./{HELDOUT} "
                  "for it)", file=sys.stderr)
        return heldout_text(), f"{HELDOUT_BOOK.capitalize()} (held-out Austen novel)"
    if not spec.strip():
        raise QinferError(f"--text is {spec!r}, empty: pass 'heldout' or a UTF-8 text file")
    path = Path(spec).expanduser()
    if path.is_dir():
        raise QinferError(f"--text {spec} is a folder: pass 'heldout' or a UTF-8 text file")
    if not path.exists():  # a pipe (--text <(...)) is read as a file is
        raise QinferError(f"--text {spec}: no such file; pass 'heldout' or a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8-sig"), str(path)  # a BOM is not text (as --calib reads it)
    except UnicodeDecodeError:
        raise QinferError(f"--text {spec} is not UTF-8 text") from None


def text_tokens(tokenizer: Tokenizer, text: str, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` tokens of ``text`` (no BOS), tokenizing only as much text as that needs."""
    n_chars = max_tokens * _CHARS_PER_TOKEN
    while True:
        ids = tokenizer.encode(text[:n_chars], add_bos=False)
        if n_chars >= len(text) or len(ids) >= max_tokens + _MARGIN:
            return torch.tensor(ids[:max_tokens], dtype=torch.long)
        n_chars *= 2


def task_accuracy(
    model: Transformer, tokenizer: Tokenizer, examples: list[MCExample], kv_dtype: str, desc: str, progress: bool = True
) -> MCResult:
    """Zero-shot accuracy (and length-normalised accuracy) of ``model`` on ``examples``."""
    forward = batch_forward(model, kv_dtype)
    with tqdm(total=len(examples), desc=desc, unit="q", disable=not progress) as bar:

        def loglik(context: str, continuations: list[str]) -> list[tuple[float, int]]:
            encode = tokenizer.encode
            if not context.strip() and not encode("") and tokenizer.eos_ids:  # an empty prompt, a model without BOS
                start = tokenizer.eos_ids[0]  # the end of a text goes before it, as lm-eval-harness conditions

                def encode(text):
                    return [start, *tokenizer.encode(text)]

            scores = continuation_loglik(forward, encode, context, continuations, batch_size=_CHOICE_BATCH,
                                         max_tokens=model.config.max_position_embeddings)
            bar.update()
            return scores

        return score_mc(examples, loglik)
