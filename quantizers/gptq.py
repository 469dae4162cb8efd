"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize ``W [N, K]`` one input column at a time, pushing each column's rounding error onto
the columns not yet quantized so as to minimise ``tr((W - W_hat) H (W - W_hat)^T)``, with ``H = X^T X``
(up to a constant) over calibration inputs ``X [M, K]``.

Steps, all in float32:

1. Dead inputs (``H[i, i] == 0``: the input never fires) get ``H[i, i] = 1`` and ``W[:, i] = 0``, which
   keeps H invertible and costs nothing since such a column never touches the output.
2. Damping: ``H += damp * mean(diag H) * I``. If the Cholesky factorisation still fails (H is not positive
   definite, e.g. accumulated in low precision) the relative damping is raised tenfold at a time up to 1.0;
   past that H is not a usable Hessian and a ``QinferError`` is raised.
3. ``U`` = upper Cholesky factor of ``H^-1``. Row ``i`` of U, divided by ``U[i, i]``, is the OBS update that
   column ``i``'s error induces on columns ``> i`` once columns ``< i`` are fixed.
4. Sweep columns in blocks: within a block updates are applied column by column; the block's accumulated
   errors reach the later columns in one matmul at the block's end ("lazy batch" updates).

Groups: without ``act_order`` a group's scale and zero come from the current, error-updated weights when
the sweep reaches the group's first column; ``blocksize`` is rounded up to a multiple of the group size so
those weights have received every update due from earlier columns. Per-channel parameters come from the
whole (dead-zeroed) W before the sweep. With ``act_order`` the columns are visited by decreasing
``diag(H)`` and groups are *static*: every group's parameters are taken from the original column order
before the sweep, so the stored layout keeps ``g(k) = k // G`` and needs no ``g_idx``.

With an unquantized target (:func:`fp_target`, ``qinfer quantize --fp-target``; "asymmetric calibration"
as in GPTAQ / GPTQv2, Li et al., 2025) the layer is fitted to what the *unquantized* model computes rather
than to its own unquantized output: with ``X`` the inputs the quantized model feeds this layer and ``X~``
the inputs the unquantized model feeds it, the objective is ``||X~ W^T - X W_hat^T||^2``. Its least-squares
minimiser over unconstrained weights is ``W* = W X~^T X H^-1 = W + W D H^-1`` with ``D = (X~ - X)^T X``,
and the objective splits into a constant plus ``tr((W* - W_hat) H (W* - W_hat)^T)``, so running the usual
sweep on ``W*`` instead of ``W`` minimises it (``H^-1`` damped as in step 2).

The same sweep quantizes onto the FP8 (E4M3) grid (:func:`gptq_fp8_ex`): the per-channel (or per-tensor)
scale is fixed from W before the sweep, each column is cast to E4M3, and its rounding error is pushed onto
the later columns exactly as for integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.errors import QinferError
from qinfer.format import Fp8Weight, QuantizedWeight, QuantScheme, check_int_shape, pack
from qinfer.quantizers.fp8 import fp8_cast, fp8_quantize
from qinfer.quantizers.rtn import ACTIVATIONS_OVERFLOW, check_finite, rtn_params


@dataclass(frozen=True)
class GptqResult:
    """The quantized weight plus what is worth logging about how it was obtained."""

    weight: QuantizedWeight | Fp8Weight
    error: float  # tr((W - W_hat) H (W - W_hat)^T) with the caller's H; for H = X^T X, ||X W^T - X W_hat^T||^2
    damp: float  # relative damping actually used (> scheme.damp when it had to be escalated)


def hessian_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """``tr((W - W_hat) H (W - W_hat)^T)``: the output error GPTQ minimises, for ``H = X^T X``."""
    D = W.float() - W_hat.float()
    return float(((D @ H.float()) * D).sum())


def _inverse_hessian_factor(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + d * mean(diag H) * I)^-1`` for the first workable ``d >= damp``."""
    mean_diag = float(H.diagonal().mean())
    tries = [damp]
    while tries[-1] * 10 < 1.0:
        tries.append(tries[-1] * 10)
    if tries[-1] < 1.0:
        tries.append(1.0)
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for d in tries:
        L, info = torch.linalg.cholesky_ex(H + (d * mean_diag) * eye)
        if info.item() != 0:
            continue
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        if info.item() == 0 and bool(torch.isfinite(U).all()):
            return U, d
    raise QinferError(
        f"Hessian is not positive definite even with damping {tries[-1]:g} x mean(diag H); "
        "it is not a valid X^T X (check the calibration activations)"
    )


def fp_target(W: torch.Tensor, H: torch.Tensor, D: torch.Tensor, damp: float, *, name: str = "weight") -> torch.Tensor:
    """``W* = W + W D H^-1`` [N, K] in fp32: the weights whose outputs on the quantized model's inputs ``X``
    (``H = X^T X``) best match ``W``'s outputs on the unquantized model's inputs ``X~`` (``D = (X~ - X)^T X``);
    ``H`` damped as GPTQ damps it, by ``damp * mean(diag H)``: a ridge on that regression, shrinking the
    correction towards ``W`` where the quantized inputs barely vary. Columns of dead inputs come out zero, as
    GPTQ would make them."""
    K = W.shape[1]
    if tuple(D.shape) != (K, K):
        raise QinferError(f"{name}: input-shift matrix shape {list(D.shape)} does not match in_features K={K}")
    check_finite(D, f"{name}: input-shift matrix", ACTIVATIONS_OVERFLOW)
    dead = H.diagonal() == 0
    W = W.detach().float()  # whole, dead columns included: an input the quantized model never fires may still
    _, H = _dead_zeroed(W, H)  # fire in the unquantized one, and the live columns take over its part of the output
    try:
        U, _ = _inverse_hessian_factor(H, damp)  # H^-1 = U^T U
    except QinferError as e:
        raise QinferError(f"{name}: {e}") from None
    target = W + ((W @ D.float()) @ U.T) @ U
    target[:, dead] = 0.0
    return target


def _check_problem(W: torch.Tensor, H: torch.Tensor, blocksize: int, name: str) -> None:
    K = W.shape[1]
    if tuple(H.shape) != (K, K):
        raise QinferError(f"{name}: Hessian shape {list(H.shape)} does not match in_features K={K}")
    if type(blocksize) is not int or blocksize < 1:
        raise QinferError(f"{name}: blocksize must be a positive int, got {blocksize!r}")
    check_finite(W, f"{name}: weight")
    check_finite(H, f"{name}: Hessian", ACTIVATIONS_OVERFLOW)
    if bool((H.diagonal() < 0).any()):
        raise QinferError(f"{name}: Hessian has negative diagonal entries; it is not X^T X")


def _dead_zeroed(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of W and H with dead inputs (``H[i, i] == 0``) handled as in step 1."""
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    return W, H


def _sweep_order(H: torch.Tensor, act_order: bool) -> torch.Tensor:
    """Sweep position -> original column: decreasing ``diag(H)`` with act-order, else the identity."""
    if act_order:
        return torch.argsort(H.diagonal(), descending=True, stable=True)
    return torch.arange(H.shape[0], device=H.device)


def _sweep(W: torch.Tensor, H: torch.Tensor, perm: torch.Tensor, scheme: QuantScheme, blocksize: int, name: str,
           quantize_column) -> float:
    """Steps 2-4 on the prepared ``W``, ``H``, visiting columns in the order ``perm``; returns the damping
    used. ``W`` is consumed.

    ``quantize_column(col, W1, i)`` quantizes sweep column ``col`` (``perm[col]`` in the original order),
    whose current values are ``W1[:, i]`` (``W1`` is the block being swept, so a group's parameters can be
    read from the columns ahead), records what it stores and returns the dequantized column.
    """
    K = W.shape[1]
    W[:], H = W[:, perm], H[perm][:, perm]
    try:
        U, damp = _inverse_hessian_factor(H, scheme.damp)
    except QinferError as e:
        raise QinferError(f"{name}: {e}") from None
    for i1 in range(0, K, blocksize):
        i2 = min(i1 + blocksize, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        diag = U1.diagonal().tolist()
        for i in range(i2 - i1):  # a few small ops per column: their count, not their size, sets the speed here
            err = Err1[:, i]
            torch.sub(W1[:, i], quantize_column(i1 + i, W1, i), out=err).div_(diag[i])
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1.0)
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return damp


def gptq_quantize_ex(
    W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, blocksize: int = 128, *, name: str = "weight"
) -> GptqResult:
    """GPTQ of ``W [N, K]`` against the Hessian ``H [K, K]`` (symmetric, e.g. ``X^T X``); see the module docstring.

    ``name`` labels error messages. Returns the weight, its Hessian-weighted error and the damping used.
    An FP8 ``scheme`` goes to :func:`gptq_fp8_ex`.
    """
    if scheme.format == "fp8":
        return gptq_fp8_ex(W, H, scheme, blocksize, name=name)
    check_int_shape(tuple(W.shape), scheme.bits, scheme.group_size, name)
    _check_problem(W, H, blocksize, name)
    N, K = W.shape
    bits, group_size, symmetric = scheme.bits, scheme.group_size, scheme.symmetric
    W0, H0 = W, H
    W, H = _dead_zeroed(W, H)

    G = K if group_size == -1 else group_size
    static = scheme.act_order or group_size == -1
    if static:
        scale, zero = rtn_params(W, bits, group_size, symmetric, mse=scheme.mse_clip, name=name)
    else:
        scale = torch.empty(N, K // G, dtype=torch.float16, device=W.device)
        zero = torch.empty(N, K // G, dtype=torch.uint8, device=W.device)
        blocksize = -(-blocksize // G) * G
    perm = _sweep_order(H, scheme.act_order)
    group_of = (perm // G).tolist()  # group (in the original order) of each column in sweep order
    codes = torch.empty(N, K, dtype=torch.uint8, device=W.device)
    maxq = (1 << bits) - 1
    # fp32 columns of the group parameters (static: all known now; dynamic: filled as each group starts)
    scale_f, zero_f = scale.float().T.contiguous(), zero.float().T.contiguous()  # [groups, N]

    def quantize_column(col: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        # quantize_codes / dequantize_codes for one column, spelled out: same arithmetic, fewer ops
        if not static and col % G == 0:
            s, z = rtn_params(W1[:, i : i + G], bits, -1, symmetric, mse=scheme.mse_clip, name=name)
            scale[:, col // G], zero[:, col // G] = s[:, 0], z[:, 0]
            scale_f[col // G], zero_f[col // G] = s[:, 0].float(), z[:, 0].float()
        g = group_of[col]
        s, z = scale_f[g], zero_f[g]
        q = torch.round(W1[:, i] / s + z).clamp_(0, maxq)
        codes[:, col] = q
        return (q - z).mul_(s)

    damp = _sweep(W, H, perm, scheme, blocksize, name, quantize_column)
    codes = codes[:, torch.argsort(perm)]
    weight = QuantizedWeight(
        qweight=pack(codes, bits),
        scale=scale,
        zero=None if symmetric else zero,
        bits=bits,
        group_size=group_size,
        shape=(N, K),
    )
    return GptqResult(weight=weight, error=hessian_error(W0, weight.dequantize(torch.float32), H0), damp=damp)


def gptq_fp8_ex(
    W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, blocksize: int = 128, *, name: str = "weight"
) -> GptqResult:
    """GPTQ's sweep with E4M3 as the grid: each column is cast to FP8 (the scale fixed per channel or per
    tensor from the dead-zeroed ``W`` before the sweep, as :func:`qinfer.quantizers.fp8.fp8_quantize` does)
    and its rounding error is pushed onto the columns not yet quantized. Columns that the updates push past
    ``448 * scale`` saturate, like any FP8 cast here."""
    if scheme.format != "fp8":
        raise QinferError(f"{name}: gptq_fp8_ex needs an fp8 scheme, got format {scheme.format!r}")
    if W.dim() != 2:
        raise QinferError(f"{name}: expected a 2-D weight [N, K], got shape {list(W.shape)}")
    _check_problem(W, H, blocksize, name)
    W0, H0 = W, H
    W, H = _dead_zeroed(W, H)
    scale = fp8_quantize(W, scheme, name=name).scale
    stored = torch.empty(W.shape, dtype=torch.float8_e4m3fn, device=W.device)
    col_scale = scale if scale.numel() > 1 else scale.expand(W.shape[0], 1)

    def quantize_column(col: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        q = fp8_cast(W1[:, i : i + 1], col_scale)
        stored[:, col] = q[:, 0]
        return q[:, 0].float() * col_scale[:, 0]

    perm = _sweep_order(H, scheme.act_order)
    damp = _sweep(W, H, perm, scheme, blocksize, name, quantize_column)
    weight = Fp8Weight(weight=stored[:, torch.argsort(perm)].contiguous(), scale=scale)
    return GptqResult(weight=weight, error=hessian_error(W0, weight.dequantize(torch.float32), H0), damp=damp)


def gptq_quantize(
    W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, blocksize: int = 128, *, name: str = "weight"
) -> QuantizedWeight | Fp8Weight:
    """GPTQ of ``W [N, K]`` against ``H [K, K]``; :func:`gptq_quantize_ex` also returns error and damping."""
    return gptq_quantize_ex(W, H, scheme, blocksize, name=name).weight
