"""Perplexity, KL divergence from a baseline, and top-1 agreement, over the same tokens in one pass.

The windows are :func:`qinfer.evals.perplexity.windows`: each scores only tokens no earlier window
scored, so every model is judged on exactly the same (position, context) pairs as the baseline. Per
scored position, with ``p`` the baseline's next-token distribution and ``q`` the model's::

    KL(p || q) = sum_v p_v (log p_v - log q_v)          (nats, the full vocabulary: exact, not top-k)
    agreement  = [argmax_v p_v == argmax_v q_v]

and the reported figures are means over all scored positions; perplexity is ``exp`` of the model's mean
negative log-likelihood, as in :func:`qinfer.evals.perplexity.perplexity`.

Memory: the baseline's logits are computed once per window and shared by all models (no second
baseline forward per model), and log-softmaxes are taken ``chunk`` positions at a time, so at most a
window's logits per model and a few ``[chunk, V]`` fp32 blocks exist at once, never ``[T, V]`` over the
whole text (Gemma's V = 262144 makes that 1 MB per token in fp32).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from qinfer.errors import QinferError
from qinfer.evals.forward import LogitsFn
from qinfer.evals.perplexity import windows


@dataclass(frozen=True)
class TextMetrics:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    kl: float  # mean KL(baseline || model) per scored token (nats)
    top1_agreement: float  # fraction of scored positions where both put the same token first
    tokens: int  # scored tokens
    window: int
    stride: int


@torch.no_grad()
def text_metrics(
    baseline: LogitsFn,
    models: Mapping[str, LogitsFn],
    tokens: torch.Tensor,
    window: int,
    stride: int,
    chunk: int = 64,
    progress: bool = True,
) -> dict[str, TextMetrics]:
    """Metrics of each of ``models`` against ``baseline`` over the 1-D token stream ``tokens``.

    A model whose callable *is* ``baseline`` reuses the baseline's logits instead of running again.
    """
    if not models:
        raise QinferError("text_metrics got no models to measure")
    spans = windows(tokens.numel(), window, stride)
    sums = {name: [0.0, 0.0, 0] for name in models}  # nll, kl, agreements
    count = 0
    bar = tqdm(spans, desc=f"perplexity + KL ({len(models)} model{'s' * (len(models) > 1)})", unit="window",
               disable=not progress)
    for start, end, first in bar:
        ids = tokens[start : end - 1]  # the window's last token is only ever a target
        targets = tokens[first:end]  # logits at positions first-1..end-2 predict these
        base = baseline(ids, first - 1 - start)  # [n, V]
        logits = {name: None if fn is baseline else fn(ids, first - 1 - start) for name, fn in models.items()}
        for i in range(0, targets.numel(), chunk):
            lp = torch.log_softmax(base[i : i + chunk].float(), dim=-1)  # [c, V]
            base_top = lp.argmax(dim=-1)
            t = targets[i : i + chunk, None].to(lp.device)
            for name, own in logits.items():
                lq = lp if own is None else torch.log_softmax(own[i : i + chunk].float(), dim=-1)
                s = sums[name]
                s[0] -= float(lq.gather(-1, t).double().sum())
                # kl_div(input=log q, target=log p, log_target=True) = p * (log p - log q), elementwise
                s[1] += float(F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1).double().sum())
                s[2] += int((lq.argmax(dim=-1) == base_top).sum())
        count += targets.numel()
    return {
        name: TextMetrics(ppl=math.exp(nll / count), nll=nll / count, kl=kl / count, top1_agreement=agree / count,
                          tokens=count, window=window, stride=stride)
        for name, (nll, kl, agree) in sums.items()
    }
