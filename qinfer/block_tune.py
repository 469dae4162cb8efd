"""Block-output tuning: a second stage after a block's linears are quantized (``qinfer quantize --tune-steps N``).

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
rounded to float16 for storage and the whole-batch loss is reported before and after.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.func import functional_call

from qinfer.errors import QinferError
from qinfer.format import QuantizedWeight, dequantize_codes
from qinfer.model import Transformer
from qinfer.quantizers.rtn import FP16_MAX


@dataclass(frozen=True)
class TuneConfig:
    steps: int = 0  # Adam steps per block; 0 = no tuning
    lr: float = 2e-3  # for the log-scales and the norm weights
    batch: int = 4  # calibration samples per step
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.batch < 1 or not self.lr > 0:
            raise QinferError(
                f"tuning needs --tune-steps >= 0, a batch >= 1 and a positive rate (got {self.steps}, {self.batch}, {self.lr})"
            )


@dataclass(frozen=True)
class TuneResult:
    loss_before: float  # mean squared output error over every calibration sample
    loss_after: float


def tune_block(
    model: Transformer,
    layer_idx: int,
    weights: dict[str, QuantizedWeight],
    X: torch.Tensor,
    Y: torch.Tensor,
    config: TuneConfig,
) -> tuple[dict[str, QuantizedWeight], TuneResult]:
    """Tune block ``layer_idx`` so that it maps X [S, L, C] closer to Y [S, L, C].

    ``weights`` maps the block's linear names to their quantized weights; the returned dict has the same
    codes and zeros with tuned scales. The block's norm weights are updated in place, and its linears are
    left holding the tuned weights dequantized in the block's dtype. Integer formats only.
    """
    block = model.model.layers[layer_idx]
    dtype = next(block.parameters()).dtype
    S, L, _ = X.shape
    pos = torch.arange(L, device=X.device)
    mask = model.masks(pos, 0)[model.config.sliding_window[layer_idx]]
    cos, sin = model.rope(layer_idx, pos, torch.float32)
    levels = {n: _levels(w) for n, w in weights.items()}
    logs = {n: torch.zeros(w.scale.shape, requires_grad=True) for n, w in weights.items()}
    norms = {n: p.detach().float().clone().requires_grad_(True) for n, p in block.named_parameters() if _is_norm(n)}

    def dense() -> dict[str, torch.Tensor]:
        return {
            f"{n}.weight": dequantize_codes(levels[n], w.scale.float() * torch.exp(logs[n]), 0, w.group_size)
            for n, w in weights.items()
        }

    def loss(idx: torch.Tensor) -> torch.Tensor:
        out = functional_call(block, {**dense(), **norms}, (X[idx].float(), cos, sin, mask, None, pos))
        return (out - Y[idx].float()).pow(2).mean()

    @torch.no_grad()
    def full_loss() -> float:
        return sum(float(loss(torch.arange(i, min(i + 8, S)))) * min(8, S - i) for i in range(0, S, 8)) / S

    block.float()
    try:
        before = full_loss()
        opt = torch.optim.Adam([*logs.values(), *norms.values()], lr=config.lr)
        gen = torch.Generator().manual_seed(config.seed + layer_idx)
        for _ in range(config.steps):
            opt.zero_grad()
            loss(torch.randint(0, S, (min(config.batch, S),), generator=gen)).backward()
            opt.step()
        tuned = {n: replace(w, scale=_fp16(w.scale.float() * torch.exp(logs[n].detach()))) for n, w in weights.items()}
        with torch.no_grad():
            for n, p in norms.items():
                block.get_parameter(n).data = p.detach()
            for n, w in tuned.items():
                block.get_submodule(n).weight.data = w.dequantize(torch.float32)
            after = full_loss()
    finally:
        block.to(dtype)
    return tuned, TuneResult(before, after)


def _levels(w: QuantizedWeight) -> torch.Tensor:
    """``q - zero`` in float32 [N, K]: what multiplies the group's scale."""
    zero = 1 << (w.bits - 1) if w.zero is None else w.zero
    return dequantize_codes(w.codes(), torch.ones_like(w.scale, dtype=torch.float32), zero, w.group_size)


def _is_norm(name: str) -> bool:
    return name.rsplit(".", 1)[0].endswith("norm")


def _fp16(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(max=FP16_MAX).half()
