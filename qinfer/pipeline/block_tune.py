"""Tuning stages after quantization: per block (``qinfer quantize --tune-steps N``) and end to end (``--e2e-steps N``).

GPTQ, AWQ and RTN each fit one linear at a time. Once every linear of decoder block ``i`` is quantized,
this stage keeps the integer codes and zero points as they are and adjusts what stays in floating point:

- each group's scale, as ``scale * exp(d)`` with one free ``d`` per group (so it stays positive), and
- the block's norm weights (stored unquantized anyway),

to minimise the mean squared difference between the quantized block's output and a target output, by
Adam over random mini-batches of calibration samples. The target is the *unquantized* model's output at
this block on the same samples (the pipeline carries that reference stream beside the quantized one), so
the tuned block also corrects the drift that earlier quantized blocks left in its input. In the spirit of
OmniQuant's learnable clipping and EfficientQAT's block-wise stage, restricted to the parameters the
stored format already has: the output is a checkpoint in the same layout as without tuning.

The block runs in float32 while tuning (bf16 gradients are too coarse for ``d``); the tuned scales are
rounded to float16 for storage and the whole-batch loss is reported before and after. Where the tuned block's
whole-batch loss ends above the quantizer's own (the steps see a few samples each), the tuning is undone.

With ``TuneConfig.holdout`` (``--tune-holdout N``) the last N calibration samples are kept out of the steps:
every ``steps / 10`` steps the block's loss on them is measured, and the parameters of the check with the
lowest held-out loss are kept (the quantizer's own where no check beat it), so a stage that goes on fitting
the training samples at the held-out ones' expense is cut back to its best check. The curve of checks is
returned (``TuneResult.held_out``): its drop against the whole-batch loss's shows how much of the fit carries
over to samples the steps did not see.

With ``TuneConfig.rounding`` (``--tune-rounding``) the block stage also learns which way each weight
rounds, as AutoRound (Cheng et al., 2023, "Optimize Weight Rounding via Signed Gradient Descent") does:
every weight's level becomes ``clamp(round(w / scale + v), lo, hi)`` with a learned ``v`` in ``[-0.5, 0.5]``
(starting at 0, so at the quantizer's own codes), the rounding passed straight through in the backward
pass. ``w / scale`` is kept as the quantizer's level plus its rounding residual (:func:`rounding_residual`,
taken when the linear was quantized), so the weights nearest a rounding boundary flip first. ``v`` moves by
signed gradient steps of ``1 / steps`` decaying linearly to 0 (AutoRound's rule), so it can travel 0.5 in
all: at most one level up or down from the nearest one. The codes change; the zero points and the layout
do not.

The end-to-end stage (:func:`tune_end_to_end`) runs once every block is quantized. It tunes the same
parameters (every group's log-scale and every norm weight, the final norm included) of all blocks at once,
on the KL divergence from the unquantized model's next-token distribution to the quantized model's, one
calibration sample per Adam step with a cosine-decayed rate: the block stage sees only its block's output
error, this one sees what the errors do to the logits. In the spirit of EfficientQAT's end-to-end stage
(which trains only the step sizes); the stored format again stays as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.func import functional_call
from tqdm import tqdm

from qinfer.calib.capture import bos_rows, first_kept
from qinfer.format import QuantizedWeight, dequantize_codes, pack
from qinfer.model.decoder import Transformer
from qinfer.pipeline.config import TuneConfig
from qinfer.quantizers.rtn import FP16_MAX


@dataclass(frozen=True)
class TuneResult:
    loss_before: float  # block stage: mean squared output error over every calibration sample;
    loss_after: float  # end-to-end stage: mean per-token KL over the first E2E_EVAL_SAMPLES samples
    discarded: bool = False  # tuning raised the error (or the KL), so the weights and norms before it were kept
    best_step: int | None = None  # block stage with a holdout: the step whose parameters were kept (0 = none)
    held_out: tuple[tuple[int, float], ...] = ()  # block stage with a holdout: (step, held-out loss) at each check


E2E_EVAL_SAMPLES = 8  # the end-to-end KL is reported on this many calibration samples (a full pass is slow)


def tune_block(
    model: Transformer,
    layer_idx: int,
    weights: dict[str, QuantizedWeight],
    X: torch.Tensor,
    Y: torch.Tensor,
    config: TuneConfig,
    residuals: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, QuantizedWeight], TuneResult]:
    """Tune block ``layer_idx`` so that it maps X [S, L, C] closer to Y [S, L, C].

    ``weights`` maps the block's linear names to their quantized weights; the returned dict has the same
    codes and zeros with tuned scales (and, with ``config.rounding``, tuned codes: ``residuals`` then maps each
    name to its :func:`rounding_residual`). The block's norm weights are updated in place, and its linears are
    left holding the tuned weights dequantized in the block's dtype. Integer formats only.
    """
    block = model.model.layers[layer_idx]
    dtype = block.get_submodule(next(iter(weights))).weight.dtype  # the block's compute dtype, restored after
    S, L, _ = X.shape
    pos = torch.arange(L, device=X.device)
    mask = model.masks(pos, 0)[model.config.sliding_window[layer_idx]]
    cos, sin = model.rope(layer_idx, pos, torch.float32)
    levels = {n: _levels(w) for n, w in weights.items()}
    logs = {n: torch.zeros(w.scale.shape, requires_grad=True) for n, w in weights.items()}
    norms = {n: p.detach().float().clone().requires_grad_(True) for n, p in block.named_parameters() if _is_norm(n)}
    untuned = {n: p.detach().clone() for n, p in norms.items()}
    rounds = {}
    if config.rounding:
        if residuals is None or set(residuals) != set(weights):
            raise ValueError("tune_block: config.rounding needs a rounding residual for every weight")
        rounds = {n: _Rounding(w, levels[n], residuals[n]) for n, w in weights.items()}

    def dense() -> dict[str, torch.Tensor]:
        return {
            f"{n}.weight": dequantize_codes(rounds[n].levels() if config.rounding else levels[n],
                                            w.scale.float() * torch.exp(logs[n]), 0, w.group_size)
            for n, w in weights.items()
        }

    first = first_kept(model)  # a stored BOS position: what the block computes there is never used

    def loss(idx: torch.Tensor) -> torch.Tensor:
        x = X[idx].float()
        out = functional_call(block, {**dense(), **norms}, (x, cos, sin, mask, None, pos, bos_rows(model, x)))
        return (out - Y[idx].float())[:, first:].pow(2).mean()

    @torch.no_grad()
    def mean_loss(idx: torch.Tensor) -> float:
        return sum(float(loss(idx[i:i + 8])) * len(idx[i:i + 8]) for i in range(0, len(idx), 8)) / len(idx)

    def state() -> list[torch.Tensor]:  # everything the steps move
        return [*logs.values(), *norms.values(), *(r.v for r in rounds.values())]

    held = min(config.holdout, S - 1)  # at least one sample left to step on
    train, val = S - held, torch.arange(S - held, S)
    block.float()
    try:
        before = mean_loss(torch.arange(S))
        best_val, best_step, best, checks = 0.0, None, None, []
        if held:  # check 0: the quantizer's own parameters
            best_val, best_step, best = mean_loss(val), 0, [t.detach().clone() for t in state()]
            checks.append((0, best_val))
        opt = torch.optim.Adam([*logs.values(), *norms.values()], lr=config.lr)
        gen = torch.Generator().manual_seed((config.seed + layer_idx) % 2**64)
        every = max(1, config.steps // 10)
        for step in range(config.steps):
            opt.zero_grad()
            loss(torch.randint(0, train, (min(config.batch, train),), generator=gen)).backward()
            opt.step()
            if config.rounding:  # AutoRound's signed step, 1 / steps decaying linearly to 0
                rate = (1 - step / config.steps) / config.steps
                for r in rounds.values():
                    r.step(rate)
            if held and ((step + 1) % every == 0 or step + 1 == config.steps):
                held_loss = mean_loss(val)
                checks.append((step + 1, held_loss))
                if held_loss < best_val:
                    best_val, best_step, best = held_loss, step + 1, [t.detach().clone() for t in state()]
        if held:  # back to the parameters of the best check
            with torch.no_grad():
                for t, b in zip(state(), best):
                    t.copy_(b)
        tuned = {n: replace(w, scale=_fp16(w.scale.float() * torch.exp(logs[n].detach()))) for n, w in weights.items()}
        if config.rounding:
            tuned = {n: rounds[n].apply(w) for n, w in tuned.items()}
        with torch.no_grad():
            for n, p in norms.items():
                block.get_parameter(n).data = p.detach()
            for n, w in tuned.items():
                block.get_submodule(n).weight.data = w.dequantize(torch.float32)
            after = mean_loss(torch.arange(S))
            # noisy minibatch steps can end worse (or, at a rate far too high, at NaN): keep the quantizer's own
            # (with a holdout: where no check beat it)
            discarded = best_step == 0 if held else not after <= before
            if discarded:
                tuned, norms, after = weights, untuned, before
                for n, w in weights.items():
                    block.get_submodule(n).weight.data = w.dequantize(torch.float32)
    finally:
        block.to(dtype)
    _keep_norms(block, norms, dtype)
    return tuned, TuneResult(before, after, discarded, best_step, tuple(checks))


def tune_end_to_end(
    model: Transformer,
    weights: dict[str, QuantizedWeight],
    ids: torch.Tensor,
    target: torch.Tensor,
    config: TuneConfig,
) -> tuple[dict[str, QuantizedWeight], TuneResult]:
    """Tune all group scales and norms so the model's next-token distribution on ``ids`` [S, L] moves
    towards the one given by ``target`` [S, L, C], the unquantized model's final-norm hidden states.

    ``weights`` maps ``model.layers.{i}.{linear}`` to every block's quantized weight; the returned dict has
    the same codes and zeros with tuned scales. Norm weights are updated in place and the blocks' linears
    are left holding the tuned weights dequantized in the model's dtype. The (unquantized) lm_head is
    shared by both sides and stays as it is.
    """
    layers = model.model.layers
    dtype = model.dtype
    S, L = ids.shape
    pos = torch.arange(L, device=ids.device)
    masks = model.masks(pos, 0)
    ropes = [model.rope(i, pos, torch.float32) for i in range(len(layers))]
    # the lm_head (its 2 * C * vocab FLOPs per token are most of a step's) multiplies in fp32: its bf16
    # matmul runs several times slower on CPUs without AVX-512 (docs/results.md, "Speed against the roofline"),
    # and fp32 is what the logits are taken in anyway
    head = model.lm_head.weight.float()
    levels = {n: _levels(w) for n, w in weights.items()}
    logs = {n: torch.zeros(w.scale.shape, requires_grad=True) for n, w in weights.items()}
    norms = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.model.named_parameters() if _is_norm(n)}
    untuned = {n: p.detach().clone() for n, p in norms.items()}

    def block_params(i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        params = {k.removeprefix(prefix): v for k, v in norms.items() if k.startswith(prefix)}
        for n, w in weights.items():
            if n.startswith(f"model.{prefix}"):
                scale = w.scale.float() * torch.exp(logs[n])
                params[f"{n.removeprefix(f'model.{prefix}')}.weight"] = dequantize_codes(levels[n], scale, 0, w.group_size)
        return params

    def log_probs(h: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(h.float() @ head.T, dim=-1)

    first = first_kept(model)  # a stored BOS position outputs the unquantized model's hidden state: nothing to tune

    def kl(idx: torch.Tensor) -> torch.Tensor:
        x = model.embed(ids[idx]).float()
        bos = model.bos_rows(ids[idx], pos)
        for i, layer in enumerate(layers):
            cos, sin = ropes[i]
            mask = masks[model.config.sliding_window[i]]
            x = functional_call(layer, block_params(i), (x, cos, sin, mask, None, pos, bos))
        lq = log_probs(functional_call(model.model.norm, {"weight": norms["norm.weight"]}, (x[:, first:],)))
        with torch.no_grad():
            lp = log_probs(target[idx, first:])
        return F.kl_div(lq, lp, reduction="sum", log_target=True) / (len(idx) * (L - first))

    @torch.no_grad()
    def eval_kl() -> float:
        n = min(S, E2E_EVAL_SAMPLES)
        return sum(float(kl(torch.tensor([i]))) for i in range(n)) / n

    tuned_parts = [*layers, model.model.norm]  # the embeddings (and a tied head) are not tuned and stay as they are
    for part in tuned_parts:
        part.float()
    try:
        before = eval_kl()
        opt = torch.optim.Adam([*logs.values(), *norms.values()], lr=config.lr)
        cosine = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / config.e2e_steps)))
        gen = torch.Generator().manual_seed(config.seed)
        order = torch.cat([torch.randperm(S, generator=gen) for _ in range(math.ceil(config.e2e_steps / S))])
        bar = tqdm(order[: config.e2e_steps], desc="end-to-end tuning", unit="step")
        for i in bar:
            opt.zero_grad()
            loss = kl(i.view(1))
            loss.backward()
            opt.step()
            cosine.step()
            bar.set_postfix(kl=f"{float(loss.detach()):.4f}")
        tuned = {n: replace(w, scale=_fp16(w.scale.float() * torch.exp(logs[n].detach()))) for n, w in weights.items()}
        with torch.no_grad():
            for n, p in norms.items():
                model.model.get_parameter(n).data = p.detach()
            for n, w in tuned.items():
                model.get_submodule(n).weight.data = w.dequantize(torch.float32)
            after = eval_kl()
            discarded = not after <= before  # as for a block: a tuning that ends worse, or at NaN, is undone
            if discarded:
                tuned, norms, after = weights, untuned, before
                for n, w in weights.items():
                    model.get_submodule(n).weight.data = w.dequantize(torch.float32)
    finally:
        for part in tuned_parts:
            part.to(dtype)
    _keep_norms(model.model, norms, dtype)
    return tuned, TuneResult(before, after, discarded)


def _keep_norms(root: torch.nn.Module, norms: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """The tuned fp32 norm weights back into ``root`` after its cast to ``dtype``, kept in fp32 where the norm
    holds fp32 (Gemma's ``1 + w``; see ``RMSNorm``)."""
    for n, p in norms.items():
        norm = root.get_submodule(n.rsplit(".", 1)[0])
        norm.weight.data = p.detach().to(norm.weight_dtype(dtype, torch.float32))


def rounding_residual(W: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Where ``W`` [N, K] sat between the levels ``w`` rounded it to, in grid steps: ``W / scale - (q - zero)``,
    clamped to just inside ``(-0.5, 0.5)`` (GPTQ's codes need not be W's nearest levels, weights past the grid
    were clipped) so that rounding level + residual gives back ``q``. Take it when ``w`` is formed: it stays
    valid when the group scales are rescaled later (AWQ's folding)."""
    return (W.float() / _expand(w.scale.float(), w) - _levels(w)).clamp(-0.49, 0.49)


class _Rounding:
    """One weight's learned rounding: levels ``clamp(round(level + residual + v), lo, hi)``, ``v`` in [-0.5, 0.5];
    ``levels`` is :func:`_levels` of ``w``."""

    def __init__(self, w: QuantizedWeight, levels: torch.Tensor, residual: torch.Tensor):
        self.zero = w.codes().float() - levels  # [N, K]
        self.lo, self.hi = -self.zero, (1 << w.bits) - 1 - self.zero
        self.start = levels + residual  # W / scale, in grid steps
        self.v = torch.zeros(w.shape, requires_grad=True)

    def levels(self) -> torch.Tensor:
        x = self.start + self.v
        return torch.clamp(x + (torch.round(x) - x).detach(), self.lo, self.hi)  # straight-through rounding

    @torch.no_grad()
    def step(self, rate: float) -> None:
        self.v -= rate * self.v.grad.sign()
        self.v.clamp_(-0.5, 0.5)
        self.v.grad = None

    @torch.no_grad()
    def apply(self, w: QuantizedWeight) -> QuantizedWeight:
        """``w`` with the learned codes."""
        return replace(w, qweight=pack((self.levels() + self.zero).round().to(torch.uint8), w.bits))


def _expand(per_group: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """[N, K/G] -> [N, K]."""
    return per_group.repeat_interleave(w.shape[1] if w.group_size == -1 else w.group_size, dim=-1)


def _levels(w: QuantizedWeight) -> torch.Tensor:
    """``q - zero`` in float32 [N, K]: what multiplies the group's scale."""
    zero = 1 << (w.bits - 1) if w.zero is None else w.zero
    return dequantize_codes(w.codes(), torch.ones_like(w.scale, dtype=torch.float32), zero, w.group_size)


def _is_norm(name: str) -> bool:
    return name.rsplit(".", 1)[0].endswith("norm")


def _fp16(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(max=FP16_MAX).half()
