"""Perplexity over a long token stream with a sliding window.

Windows of ``window`` tokens advance by ``stride``; each window scores only the tokens no earlier window
scored (a window never scores its own first token, which has no context inside it), so no token is scored
twice, and every token a later window scores sees at least ``window - stride`` tokens of context; the first
window scores all of its tokens but the first, from one token of context up. With ``stride < window``
every token but the very first is scored. This is Hugging Face's strided perplexity; llama.cpp's
``llama-perplexity`` instead cuts the text into non-overlapping chunks and scores each chunk's second half,
so the two give different numbers on the same text.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from qinfer.errors import QinferError


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    window: int
    stride: int


def exp(x: float) -> float:
    """``math.exp(x)``, infinite past float64's range: a broken model's mean loss over 709 nats is a perplexity
    of inf, not an error."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) for each window over ``n_tokens`` tokens."""
    if n_tokens < 2:
        raise QinferError(f"the text has {n_tokens} tokens; perplexity needs at least 2")
    if not 0 < stride <= window:
        raise QinferError(f"stride must be in 1..window ({window}), got {stride}")
    spans, scored_to = [], 1
    for start in range(0, n_tokens, stride):
        end = min(start + window, n_tokens)
        if end <= scored_to:
            break
        spans.append((start, end, max(scored_to, start + 1)))  # a window cannot score its own first token
        scored_to = end
        if end == n_tokens:
            break
    return spans


def token_nll(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    # logits: [T, V] (any float dtype), targets: [T] -> nll [T] in fp32, chunked to bound fp32 memory
    out = []
    for i in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[i : i + chunk].float(), dim=-1)
        out.append(-lp.gather(-1, targets[i : i + chunk, None]).squeeze(-1))
    return torch.cat(out)


@torch.no_grad()
def perplexity(
    forward: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    window: int = 512,
    stride: int = 256,
    progress: bool = True,
) -> PerplexityResult:
    """``forward(ids [1, T]) -> logits [1, T, V]``; ``tokens`` is a 1-D LongTensor."""
    spans = windows(tokens.numel(), window, stride)
    total, count = 0.0, 0
    for start, end, first in tqdm(spans, desc="perplexity", unit="win", disable=not progress):
        ids = tokens[start:end][None]
        logits = forward(ids)[0]  # [T, V]
        # logits at position p predict token p + 1; score targets first..end-1
        nll = token_nll(logits[first - 1 - start : end - 1 - start], tokens[first:end])
        total += float(nll.double().sum())
        count += nll.numel()
    mean = total / count
    return PerplexityResult(ppl=exp(mean), nll=mean, tokens=count, window=window, stride=stride)
