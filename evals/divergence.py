"""Perplexity, KL divergence from a baseline, and top-1 agreement, over the same tokens in one pass.

The windows are :func:`qinfer.evals.perplexity.windows`: each scores only tokens no earlier window
scored, so every model is judged on exactly the same (position, context) pairs as the baseline. Per
scored position, with ``p`` the baseline's next-token distribution and ``q`` the model's::

    KL(p || q) = sum_v p_v (log p_v - log q_v)          (nats, the full vocabulary: exact, not top-k)
    agreement  = [argmax_v p_v == argmax_v q_v]

and the reported figures are means over all scored positions; perplexity is ``exp`` of the model's mean
negative log-likelihood, as in :func:`qinfer.evals.perplexity.perplexity`.

Uncertainty. ``nll_delta`` is the mean of ``d_t = nll_model(t) - nll_baseline(t)`` over the same positions, so
``ppl / ppl_baseline = exp(nll_delta)``; because both models see the same tokens, the text's own difficulty
cancels in ``d_t`` and what is left is how much the comparison would move on other text of the same kind.
``nll_delta_se`` and ``kl_se`` are the standard errors of the two means by batch means: the positions, in text
order, are cut into consecutive blocks (the remainder joins the last one), and the standard error is the
spread of the ``m`` block means ``b_j`` about the overall mean, ``sqrt(sum_j (b_j - mean)^2 / (m (m - 1)))``.
Neighbouring tokens' errors are correlated (a passage that is hard for a quantized model stays hard for a
while), so a per-token standard error understates it; the blocks are made as long as the text allows while
keeping :data:`SE_BLOCKS` of them, and never shorter than :data:`SE_MIN_BLOCK` tokens (:func:`se_block`):
on 2048 tokens, 15 blocks of 128; on 32768, 16 of 2047. On a short text that is a floor, not an estimate:
some passages are harder for a quantized model than others over spans longer than such a text: on
gemma3-270m's held-out book (``python -m qinfer.evals.diagnostics.text_spread``), the perplexity changes and KLs
of 16 passages of 2048 tokens spread by more than the standard error each passage reports for itself (the
figures: docs/results.md, "How precise these numbers are"). It covers only the choice of text: a model
quantized again on other calibration samples moves as well.

Memory: the baseline's logits are computed once per window and shared by all models (no second
baseline forward per model); the models then run one after another, each model's logits let go before the
next one's forward, and log-softmaxes are taken ``chunk`` positions at a time, so at most two windows'
logits (the baseline's and one model's) and a few ``[chunk, V]`` fp32 blocks exist at once, never ``[T, V]``
over the whole text (Gemma's V = 262144 makes that 1 MB per token in fp32; a 511-position window's logits are
0.27 GB in bf16). The baseline's log-softmax is taken again for each model, a few percent of the time.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from qinfer.errors import QinferError
from qinfer.evals.forward import LogitsFn
from qinfer.evals.perplexity import exp, windows


@dataclass(frozen=True)
class TextMetrics:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    kl: float  # mean KL(baseline || model) per scored token (nats)
    top1_agreement: float  # fraction of scored positions where both put the same token first
    tokens: int  # scored tokens
    window: int
    stride: int
    nll_delta: float | None = None  # mean nll(model) - nll(baseline) per scored token: ppl / ppl_baseline = exp(it)
    nll_delta_se: float | None = None  # its standard error by batch means (None: fewer than two blocks)
    kl_se: float | None = None  # the standard error of ``kl``, likewise

    @property
    def ppl_ratio(self) -> float | None:
        """ppl / ppl_baseline (None in results measured before ``nll_delta`` was kept)."""
        return None if self.nll_delta is None else exp(self.nll_delta)

    @property
    def ppl_change(self) -> float | None:
        """The perplexity's change against the baseline, in percent."""
        return None if self.nll_delta is None else 100 * (self.ppl_ratio - 1)

    @property
    def ppl_change_se(self) -> float | None:
        """Its standard error in percentage points (the delta method: d exp(x) = exp(x) dx)."""
        return None if self.nll_delta_se is None else 100 * self.ppl_ratio * self.nll_delta_se


SE_BLOCKS = 16  # blocks of the batch-means standard errors, when the text is long enough ...
SE_MIN_BLOCK = 128  # ... for blocks of at least this many tokens


def se_block(tokens: int) -> int:
    """Tokens per block of the standard errors over ``tokens`` scored positions."""
    return max(SE_MIN_BLOCK, tokens // SE_BLOCKS)


def batch_means_se(values: torch.Tensor, block: int) -> float | None:
    """Standard error of ``values.mean()`` for a 1-D series whose neighbours are correlated, by batch means.

    Consecutive blocks of ``block`` values (the remainder joins the last block); ``None`` with fewer than
    two blocks, where there is nothing to estimate a spread from.
    """
    m = values.numel() // block
    if m < 2:
        return None
    v = values.double()
    sizes = [block] * (m - 1) + [v.numel() - block * (m - 1)]
    means = torch.stack([b.mean() for b in torch.split(v, sizes)])
    return float(((means - v.mean()).pow(2).sum() / (m * (m - 1))).sqrt())


@dataclass(frozen=True)
class TokenSeries:
    """One model's per-position figures over the scored positions, in text order (all ``[n]``, on the CPU)."""

    nll: torch.Tensor  # float64: the model's negative log-likelihood of the token
    baseline_nll: torch.Tensor  # float64: the baseline's, at the same position
    kl: torch.Tensor  # float64: KL(baseline || model) there
    agree: torch.Tensor  # bool: both put the same token first

    def __getitem__(self, positions: slice) -> "TokenSeries":
        """The same figures over a stretch of the positions (``series[a:b]``)."""
        return TokenSeries(self.nll[positions], self.baseline_nll[positions], self.kl[positions], self.agree[positions])

    def metrics(self, window: int, stride: int, block: int | None = None) -> TextMetrics:
        """The means, with standard errors over blocks of ``block`` tokens (default: :func:`se_block`)."""
        n = self.nll.numel()
        block = se_block(n) if block is None else block
        nll, delta = float(self.nll.sum()) / n, self.nll - self.baseline_nll
        return TextMetrics(
            ppl=exp(nll), nll=nll, kl=float(self.kl.sum()) / n, top1_agreement=int(self.agree.sum()) / n,
            tokens=n, window=window, stride=stride, nll_delta=float(delta.mean()),
            nll_delta_se=batch_means_se(delta, block), kl_se=batch_means_se(self.kl, block),
        )


@torch.no_grad()
def text_metrics(
    baseline: LogitsFn,
    models: Mapping[str, LogitsFn],
    tokens: torch.Tensor,
    window: int,
    stride: int,
    chunk: int = 64,
    progress: bool = True,
    block: int | None = None,
) -> dict[str, TextMetrics]:
    """Metrics of each of ``models`` against ``baseline`` over the 1-D token stream ``tokens``.

    A model whose callable *is* ``baseline`` reuses the baseline's logits instead of running again.
    """
    series = token_series(baseline, models, tokens, window, stride, chunk, progress)
    return {name: s.metrics(window, stride, block) for name, s in series.items()}


@torch.no_grad()
def token_series(
    baseline: LogitsFn,
    models: Mapping[str, LogitsFn],
    tokens: torch.Tensor,
    window: int,
    stride: int,
    chunk: int = 64,
    progress: bool = True,
) -> dict[str, TokenSeries]:
    """The per-position figures :func:`text_metrics` reduces, for each of ``models``, in one pass over the text."""
    if not models:
        raise QinferError("text_metrics got no models to measure")
    parts = {name: ([], [], [], []) for name in models}  # nll, baseline nll, kl, agreement: one tensor per window
    bar = tqdm(windows(tokens.numel(), window, stride), desc=f"perplexity + KL ({len(models)} model"
               f"{'s' * (len(models) > 1)})", unit="window", disable=not progress)
    for start, end, first in bar:
        ids = tokens[start : end - 1]  # the window's last token is only ever a target
        targets = tokens[first:end]  # logits at positions first-1..end-2 predict these
        base = baseline(ids, first - 1 - start)  # [n, V]
        for name, fn in models.items():
            own = None if fn is baseline else fn(ids, first - 1 - start)
            for part, values in zip(parts[name], _window_figures(base, own, targets, chunk)):
                part.append(values)
            del own  # before the next model's forward: one model's window logits beside the baseline's at a time
    return {name: TokenSeries(*(torch.cat(x) for x in p)) for name, p in parts.items()}


def _window_figures(base: torch.Tensor, own: torch.Tensor | None, targets: torch.Tensor, chunk: int,
                   ) -> tuple[torch.Tensor, ...]:
    """(nll, baseline nll, kl, agreement) at a window's scored positions, each one tensor, from the baseline's
    logits ``base`` and a model's ``own`` (None: the baseline itself), log-softmaxed ``chunk`` positions at a time."""
    nll, base_nll, kl, agree = [], [], [], []
    for i in range(0, targets.numel(), chunk):
        lp = torch.log_softmax(base[i : i + chunk].float(), dim=-1)  # [c, V]
        lq = lp if own is None else torch.log_softmax(own[i : i + chunk].float(), dim=-1)
        t = targets[i : i + chunk, None].to(lp.device)
        nll.append(-lq.gather(-1, t)[:, 0].double().cpu())
        base_nll.append(-lp.gather(-1, t)[:, 0].double().cpu())
        # kl_div(input=log q, target=log p, log_target=True) = p * (log p - log q), elementwise
        kl.append(F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1).double().cpu())
        agree.append((lq.argmax(dim=-1) == lp.argmax(dim=-1)).cpu())
    return tuple(torch.cat(x) for x in (nll, base_nll, kl, agree))
