"""The linear entry point: ``y = x @ W^T + b`` for whatever form ``W`` is stored in.

A dense tensor goes to ``torch.nn.functional.linear``. A packed weight registers its kernel with
``register`` (keyed by the weight's type), so new formats plug in without touching the model, and
optionally the dtype that kernel multiplies in (``matmul_dtype``), which MFU takes its ceiling from.

A single bf16 row on CPU (a decode step at batch 1) goes to ``gemv_cpu``'s C kernel where it is built; else
it bypasses oneDNN: for ``M == 1`` its bf16 matmul streams a weight from memory at 7-15 GB/s on 2 cores where
ATen's own GEMV (also fp32 accumulation) streams 15-29 GB/s, 2.3x as fast on gemma3's lm_head
(``evals/RESULTS-LOG.md``). At 4 rows oneDNN is already faster. The switch is the process-wide
``torch.backends.mkldnn.enabled``, restored after the call.

A CPU without native half-precision GEMMs (AVX2 only: no AVX512-BF16 or AMX; oneDNN declines bf16 there and
torch falls back to a generic kernel, 5-8x slower than its fp32 GEMM on 2 AMD EPYC cores) multiplies
``HALF_FP32_MIN_ROWS`` rows or more of bf16/fp16 in fp32 instead: x and W widened, the product rounded back
to x's dtype, which is what a native half GEMM (fp32 accumulation) returns up to the order of its sums.
Fewer rows keep the half product, where widening the weight would cost more than it saves.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qinfer.kernels import gemv_cpu

_KERNELS: dict[type, Callable] = {}
_MATMUL_DTYPES: dict[type, Callable] = {}
HALF_FP32_MIN_ROWS = 8  # from this many rows on, a CPU without native half GEMMs multiplies them in fp32
_WIDEN_CHUNK = 1 << 24  # weight elements widened to fp32 at a time (64 MB; gemma3's lm_head: 10 chunks)


@functools.cache
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` GEMMs on this CPU (its own test: bf16 needs AVX-512, fp16 AVX512-FP16 or
    AMX-FP16); without it, torch's fallback for a bf16 or fp16 GEMM is 5-8x slower than its fp32 one."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def product_dtype(dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    """The dtype a dense product of ``rows`` rows of ``dtype`` multiplies in on ``device``."""
    if device.type == "cpu" and rows >= HALF_FP32_MIN_ROWS and not native_half_gemm(dtype):
        return torch.float32
    return dtype


def register(weight_type: type, kernel: Callable, matmul_dtype: Callable | None = None) -> None:
    """Route ``linear(x, w, b)`` for ``isinstance(w, weight_type)`` to ``kernel(x, w, b)``.

    ``matmul_dtype(w, x_dtype, device, rows)`` names the dtype that kernel's multiply-adds run in for
    ``rows`` rows of ``x``; without it, a dense product's (:func:`product_dtype`: a dequantize-then-matmul kernel).
    """
    _KERNELS[weight_type] = kernel
    if matmul_dtype is not None:
        _MATMUL_DTYPES[weight_type] = matmul_dtype


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K]; weight: [N, K] dense or packed; returns [..., N] in x's dtype
    # Kernels get x as [M, K]: for a 3-D input whose leading strides it does not fold (a prefill's last
    # position, h[:, -1:] of [1, T, C]), torch.matmul broadcasts the weight to a batch and copies it, which
    # for gemma3's 262144 x 640 lm_head was a 335 MB transposing copy per call, most of a 512-token prefill.
    lead = x.shape[:-1]
    y = _linear_2d(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
    return y.view(*lead, y.shape[-1])


def _linear_2d(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        if x.shape[0] == 1 and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu":
            if gemv_cpu.bf16_supported(x, weight):
                return gemv_cpu.bf16_gemv(x, weight, bias)
            return _without_onednn(x, weight, bias)
        dtype = product_dtype(x.dtype, x.device, x.shape[0])
        if dtype != x.dtype:
            return _widened(x, weight, bias, dtype)
        return F.linear(x, weight, bias)
    for cls in type(weight).__mro__:
        if cls in _KERNELS:
            return _KERNELS[cls](x, weight, bias)
    raise TypeError(f"no linear kernel registered for weights of type {type(weight).__name__}")


def _without_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    onednn = torch.backends.mkldnn
    enabled, onednn.enabled = onednn.enabled, False
    try:
        return F.linear(x, weight, bias)
    finally:
        onednn.enabled = enabled


def _widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    # the product in ``dtype``, rounded to x's dtype; the weight widened a slice of output rows at a time
    xw = x.to(dtype)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    rows = max(1, _WIDEN_CHUNK // weight.shape[1])
    for n in range(0, weight.shape[0], rows):
        b = None if bias is None else bias[n : n + rows].to(dtype)
        out[:, n : n + rows] = F.linear(xw, weight[n : n + rows].to(dtype), b)
    return out


def matmul_dtype(weight, x_dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    """The dtype ``linear(x, weight)`` multiplies in for ``rows`` rows of ``x`` of ``x_dtype`` on ``device``."""
    for cls in type(weight).__mro__:
        if cls in _MATMUL_DTYPES:
            return _MATMUL_DTYPES[cls](weight, x_dtype, device, rows)
    return product_dtype(x_dtype, device, rows)
