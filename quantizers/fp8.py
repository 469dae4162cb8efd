"""FP8 (E4M3) weight quantization and KV-cache scales.

``scale = absmax / 448`` maps the largest magnitude onto E4M3's largest finite value, per output channel
(``[N, 1]``) or per tensor (``[1]``). Values are divided by the scale, clamped to ±448 (the cast must never
see a value past the range: E4M3 "fn" has no infinity, and a cast that does not saturate yields NaN) and
rounded to nearest by the cast.

Error: E4M3 has 3 mantissa bits, so in its normal range (``|x| >= 2^-6``) rounding moves ``x = w / scale``
by at most half a unit in the last place, ``2^-4 |x|``; below it the subnormal step is ``2^-9``, so the
absolute error is at most ``2^-10``. Hence ``|w - w_hat| <= max(2^-4 |w|, 2^-10 scale)`` for any w within
``[-448, 448] * scale``.

KV-cache scales are data computed from calibration: an absmax per KV head and channel ``[Hkv, D]`` becomes
the scale the cache divides by on write, ``absmax / 448`` for FP8 and ``absmax / 127`` for symmetric INT8.
"""

from __future__ import annotations

import torch

from qinfer.errors import QinferError
from qinfer.format import FP8_MAX, Fp8Weight, QuantScheme
from qinfer.quantizers.rtn import ACTIVATIONS_OVERFLOW, check_finite

INT8_MAX = 127.0


def _scale_from_absmax(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    # An all-zero channel/head has no range to map; 1.0 reproduces its zeros and is vLLM's default KV scale.
    # A range of fp32 subnormals would give a scale of 0 (and NaN codes): the least normal float32 instead.
    absmax = absmax.float()
    scale = (absmax / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(absmax > 0, scale, torch.ones_like(absmax))


def fp8_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to ±448 and rounded to float8_e4m3fn; ``scale`` broadcasts against ``x``."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_quantize(W: torch.Tensor, scheme: QuantScheme, *, name: str = "weight") -> Fp8Weight:
    """E4M3 quantization of ``W [N, K]`` with a per-channel or per-tensor absmax scale (``fp8_granularity``)."""
    if scheme.format != "fp8":
        raise QinferError(f"{name}: fp8_quantize needs an fp8 scheme, got format {scheme.format!r}")
    if W.dim() != 2:
        raise QinferError(f"{name}: expected a 2-D weight [N, K], got shape {list(W.shape)}")
    check_finite(W, f"{name}: weight")
    if scheme.fp8_granularity == "channel":
        absmax = W.abs().amax(dim=1, keepdim=True)
    else:
        absmax = W.abs().amax().reshape(1)
    scale = _scale_from_absmax(absmax, FP8_MAX)
    return Fp8Weight(weight=fp8_cast(W, scale), scale=scale)


def _kv_scale(absmax: torch.Tensor, qmax: float, name: str) -> torch.Tensor:
    check_finite(absmax, name, ACTIVATIONS_OVERFLOW)
    if bool((absmax < 0).any()):
        raise QinferError("KV absmax has negative entries; pass max(|k|) (or max(|v|)) per KV head and channel")
    return _scale_from_absmax(absmax, qmax)


def fp8_kv_scale(absmax: torch.Tensor, name: str = "KV absmax") -> torch.Tensor:
    """FP8 KV-cache scale ``absmax / 448`` (float32, same shape; 1.0 where absmax is 0); ``name`` labels errors."""
    return _kv_scale(absmax, FP8_MAX, name)


def int8_kv_scale(absmax: torch.Tensor, name: str = "KV absmax") -> torch.Tensor:
    """Symmetric INT8 KV-cache scale ``absmax / 127`` (float32, same shape; 1.0 where absmax is 0); ``name`` labels
    errors."""
    return _kv_scale(absmax, INT8_MAX, name)
