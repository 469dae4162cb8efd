"""Round-to-nearest (RTN) integer quantization, and the grid helpers GPTQ and AWQ share.

Grid of one group (``maxq = 2^b - 1``; the group's values are ``x``):

- asymmetric: the range ``[min(x, 0), max(x, 0)]`` (it always contains 0, so the zero point is a valid
  code) is split into ``maxq`` steps: ``scale = (hi - lo) / maxq``, ``zero = round(-lo / scale)``.
- symmetric: ``scale = 2 * absmax / maxq`` with the fixed zero ``2^(b-1)``, the GPTQ convention. The grid
  ``[-2^(b-1), 2^(b-1) - 1] * scale`` reaches ``absmax`` to within half a step at both ends, so no code is
  wasted on the side that ``absmax / (2^(b-1) - 1)`` scaling would leave unused.

The scale is stored in float16 and rounded *up* to the next float16 when the cast would shrink it, and
codes are always computed against the stored scale. Then the grid still covers the group's range and every
weight reconstructs to within half a step: ``|w - w_hat| <= scale / 2`` (up to float32 rounding of the
division). A group whose range is 0 (all zeros) gets the zero point ``2^(b-1)`` (its codes are that too) and the
least float16 scale, ``2^-24``: any scale reproduces 0 exactly, and the least one keeps a kernel's rounding of
the group's products (which factor the zero point out: ``s * (sum q x - z sum x)``) as small as the group is.

Clip search (``mse=True``; ``qinfer quantize --mse-clip``), the ``mse`` option of the GPTQ authors' code: the
range above is shrunk by each factor ``1, 0.99, ..., 0.21`` (for asymmetric grids both ends alike) and each
group keeps the factor that minimises ``sum |w - w_hat|^2.4`` over the group. Outlying weights are then clamped
to the grid's end, and the half-step bound holds only for the weights inside the shrunk range.
"""

from __future__ import annotations

import torch

from qinfer.errors import QinferError
from qinfer.format import QuantizedWeight, QuantScheme, check_int_shape, pack

FP16_MAX = torch.finfo(torch.float16).max
LEAST_SCALE = 2.0**-24  # the least positive float16: an all-zero group's scale


def _groups(W: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = W.shape
    G = K if group_size == -1 else group_size
    return W.reshape(N, K // G, G)


def _fp16_scale_up(scale: torch.Tensor, name: str) -> torch.Tensor:
    if not bool((scale <= FP16_MAX).all()):
        raise QinferError(f"{name}: weights too large for a float16 scale (max scale {scale.max().item():.3g}): "
                          "weights this large are no trained model's; check the checkpoint")
    s16 = scale.half()
    short = s16.float() < scale
    return torch.where(short, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)


MSE_NORM, MSE_GRID, MSE_MIN_SHRINK = 2.4, 100, 0.2  # the clip search's error norm and shrink factors


def rtn_params(
    W: torch.Tensor, bits: int, group_size: int, symmetric: bool, *, mse: bool = False, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale float16 [N, K/G], zero uint8 [N, K/G])`` for ``W [N, K]`` (see the module docstring;
    ``mse`` turns on the clip search).

    For symmetric grids ``zero`` is filled with the implicit ``2^(bits-1)``, so callers treat both cases alike.
    """
    maxq = (1 << bits) - 1
    x = _groups(W.float(), group_size)
    if symmetric:
        lo = -x.abs().amax(dim=-1)
        hi = -lo
    else:
        lo = x.amin(dim=-1).clamp(max=0.0)
        hi = x.amax(dim=-1).clamp(min=0.0)
    if mse:
        shrink = _best_shrink(x, lo, hi, maxq, symmetric)
        lo, hi = lo * shrink, hi * shrink
    scale = (hi - lo) / maxq
    flat = scale == 0  # an all-zero group
    scale = _fp16_scale_up(torch.where(flat, torch.full_like(scale, LEAST_SCALE), scale), name)
    middle = torch.full_like(scale, 1 << (bits - 1), dtype=torch.uint8)
    if symmetric:
        return scale, middle
    zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.uint8)
    return scale, torch.where(flat, middle, zero)


_CANDIDATE_BUDGET = 1 << 18  # elements per clip-search op (several shrink factors at once); the fastest of 2^16 .. 2^19


def _best_shrink(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, maxq: int, symmetric: bool) -> torch.Tensor:
    """The clip search: per group of ``x [N, groups, G]``, the factor on ``[lo, hi]`` with the least error.

    Each error is summed in grid steps, ``scale^2.4 * sum |w / scale - (q - zero)|^2.4``, with ``|r|^2.4`` formed as
    ``exp(2.4 log |r|)`` (cheaper than ``pow``: docs/results.md, "Figures formerly in code comments") and ``|r|``
    held at 1e-6 and up: at 0, ``log`` and ``exp``
    take a slow path, and Gemma's dequantized GGUF weights are 7% zeros. A small ``x`` (one group column of GPTQ's
    sweep without act-order) is scored for several factors per op. Ties go to the larger factor.
    """
    factors = torch.tensor([1 - i / MSE_GRID for i in range(round((1 - MSE_MIN_SHRINK) * MSE_GRID))])
    per_op = max(1, _CANDIDATE_BUDGET // x.numel())
    best = torch.full_like(lo, float("inf"))
    best_shrink = torch.ones_like(lo)
    for i in range(0, len(factors), per_op):
        p = factors[i : i + per_op].view(-1, 1, 1)  # [factors, 1, 1] against lo, hi [N, groups]
        scale = ((hi - lo) * p / maxq).clamp(min=torch.finfo(torch.float32).tiny)
        zero = torch.full_like(scale, (maxq + 1) // 2) if symmetric else torch.round(-lo * p / scale)
        y = x / scale.unsqueeze(-1)
        r = torch.clamp(torch.round(y) + zero.unsqueeze(-1), 0, maxq).sub_(zero.unsqueeze(-1)).sub_(y)
        in_steps = r.abs_().clamp_(min=1e-6).log_().mul_(MSE_NORM).exp_().sum(dim=-1)  # [factors, N, groups]
        err, pick = (in_steps * scale.pow(MSE_NORM)).min(dim=0)  # the first of equal errors: the larger factor
        better = err < best
        best = torch.where(better, err, best)
        best_shrink = torch.where(better, p.flatten()[pick], best_shrink)
    return best_shrink


def quantize_codes(
    W: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """Codes ``clamp(round(W / scale + zero), 0, 2^bits - 1)`` as uint8 ``[N, K]``, scale/zero ``[N, K/G]``."""
    maxq = (1 << bits) - 1
    x = _groups(W.float(), group_size)
    q = torch.round(x / scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).clamp(0, maxq)
    return q.to(torch.uint8).reshape(W.shape)


# The fix for calibration activations, or statistics of them (a Hessian, K/V ranges), that are not finite where every
# weight is (the pipeline checks the weights first): the model's own arithmetic overflows.
ACTIVATIONS_OVERFLOW = ("the model's activations overflow there on the calibration text though every weight is finite; "
                        "check the checkpoint (does `qinfer generate` on it give text?)")


def check_finite(t: torch.Tensor, what: str, fix: str = "") -> None:
    if not bool(torch.isfinite(t).all()):
        raise QinferError(f"{what} contains NaN or Inf" + (f": {fix}" if fix else ""))


def rtn_quantize(W: torch.Tensor, scheme: QuantScheme, *, name: str = "weight") -> QuantizedWeight:
    """Round-to-nearest quantization of ``W [N, K]`` under an integer ``scheme``; ``name`` labels errors."""
    if scheme.format != "int":
        raise QinferError(f"{name}: rtn_quantize needs an integer scheme, got format {scheme.format!r}")
    check_int_shape(tuple(W.shape), scheme.bits, scheme.group_size, name)
    check_finite(W, f"{name}: weight")
    scale, zero = rtn_params(W, scheme.bits, scheme.group_size, scheme.symmetric, mse=scheme.mse_clip, name=name)
    codes = quantize_codes(W, scale, zero, scheme.bits, scheme.group_size)
    return QuantizedWeight(
        qweight=pack(codes, scheme.bits),
        scale=scale,
        zero=None if scheme.symmetric else zero,
        bits=scheme.bits,
        group_size=scheme.group_size,
        shape=tuple(W.shape),
    )
