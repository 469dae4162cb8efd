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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.errors import QinferError
from qinfer.format import QuantizedWeight, QuantScheme, check_int_shape, dequantize_codes, pack
from qinfer.quantizers.rtn import check_finite, quantize_codes, rtn_params


@dataclass(frozen=True)
class GptqResult:
    """The quantized weight plus what is worth logging about how it was obtained."""

    weight: QuantizedWeight
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


def gptq_quantize_ex(
    W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, blocksize: int = 128, *, name: str = "weight"
) -> GptqResult:
    """GPTQ of ``W [N, K]`` against the Hessian ``H [K, K]`` (symmetric, e.g. ``X^T X``); see the module docstring.

    ``name`` labels error messages. Returns the weight, its Hessian-weighted error and the damping used.
    """
    if scheme.format != "int":
        raise QinferError(f"{name}: GPTQ needs an integer scheme, got format {scheme.format!r}")
    check_int_shape(tuple(W.shape), scheme.bits, scheme.group_size, name)
    N, K = W.shape
    if tuple(H.shape) != (K, K):
        raise QinferError(f"{name}: Hessian shape {list(H.shape)} does not match in_features K={K}")
    if type(blocksize) is not int or blocksize < 1:
        raise QinferError(f"{name}: blocksize must be a positive int, got {blocksize!r}")
    check_finite(W, f"{name}: weight")
    check_finite(H, f"{name}: Hessian")
    if bool((H.diagonal() < 0).any()):
        raise QinferError(f"{name}: Hessian has negative diagonal entries; it is not X^T X")

    bits, group_size, symmetric = scheme.bits, scheme.group_size, scheme.symmetric
    W0, H0 = W, H
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0

    G = K if group_size == -1 else group_size
    static = scheme.act_order or group_size == -1
    if static:
        scale, zero = rtn_params(W, bits, group_size, symmetric, name=name)
    else:
        scale = torch.empty(N, K // G, dtype=torch.float16, device=W.device)
        zero = torch.empty(N, K // G, dtype=torch.uint8, device=W.device)
        blocksize = -(-blocksize // G) * G

    if scheme.act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    else:
        perm = torch.arange(K, device=W.device)
    group_of = (perm // G).tolist()  # group (in the original order) of each column in sweep order

    try:
        U, damp = _inverse_hessian_factor(H, scheme.damp)
    except QinferError as e:
        raise QinferError(f"{name}: {e}") from None

    codes = torch.empty(N, K, dtype=torch.uint8, device=W.device)
    for i1 in range(0, K, blocksize):
        i2 = min(i1 + blocksize, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static and col % G == 0:
                s, z = rtn_params(W1[:, i : i + G], bits, -1, symmetric, name=name)
                scale[:, col // G], zero[:, col // G] = s[:, 0], z[:, 0]
            g = group_of[col]
            s, z = scale[:, g : g + 1], zero[:, g : g + 1]
            q = quantize_codes(W1[:, i : i + 1], s, z, bits, -1)
            codes[:, col] = q[:, 0]
            err = (W1[:, i] - dequantize_codes(q, s, z, -1)[:, 0]) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

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


def gptq_quantize(
    W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, blocksize: int = 128, *, name: str = "weight"
) -> QuantizedWeight:
    """GPTQ of ``W [N, K]`` against ``H [K, K]``; :func:`gptq_quantize_ex` also returns error and damping."""
    return gptq_quantize_ex(W, H, scheme, blocksize, name=name).weight
