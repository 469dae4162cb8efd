"""Dense linears: ``y = x @ W^T + b`` for a plain tensor ``W`` on whatever device it lives.

A few bf16 rows on CPU (a decode step, or a batch of up to ``gemv_cpu.bf16_rows_max()`` of them: 64 on a CPU with
AVX512-BF16, else 4) go to ``gemv_cpu``'s C kernel where it is built: each row's output the bits it has alone, and
from a weight read once for all of them (past that many rows oneDNN's matmul is faster or level: ``gemv_cpu``);
``dense_dtype`` names the dtype each path multiplies in. A single row without the kernel bypasses oneDNN: for
``M == 1`` its bf16 matmul streams a weight from memory at a fraction of the rate of ATen's own GEMV (also fp32
accumulation); at a few rows oneDNN is already faster (measured in ``docs/RESULTS-LOG.md``). The switch is the
process-wide ``torch.backends.mkldnn.enabled``, restored after the call.

A CPU without native half-precision GEMMs (AVX2 only: no AVX512-BF16 or AMX; oneDNN declines bf16 there and
torch falls back to a generic kernel several times slower than its fp32 GEMM) multiplies
``HALF_FP32_MIN_ROWS`` rows or more of bf16/fp16 in fp32 instead: x and W widened, the product rounded back
to x's dtype, which is what a native half GEMM (fp32 accumulation) returns up to the order of its sums.
Fewer rows keep the half product, where widening the weight would cost more than it saves.
"""

import functools
import torch
import torch.nn.functional as F

from qinfer.kernels import gemv_cpu

HALF_FP32_MIN_ROWS = 8  # from this many rows on, a CPU without native half GEMMs multiplies them in fp32
_WIDEN_CHUNK = 1 << 24  # weight elements widened to fp32 at a time (64 MB; gemma3's lm_head: 10 chunks)


@functools.cache
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` GEMMs on this CPU (its own test: bf16 needs AVX-512, fp16 AVX512-FP16 or
    AMX-FP16); without it, torch's fallback for a bf16 or fp16 GEMM is several times slower than its fp32 one
    (docs/results.md, "Speed against the roofline" and "Figures formerly in code comments")."""
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


def dense_dtype(weight: torch.Tensor, x_dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    """The dtype ``dense_linear`` multiplies ``rows`` rows of ``x_dtype`` against ``weight`` in: bf16 for the rows
    ``gemv_cpu``'s C GEMV takes (bf16 products, exact in fp32, summed in fp32), else :func:`product_dtype`."""
    if device.type == "cpu" and x_dtype == weight.dtype == torch.bfloat16 and gemv_cpu.cpu_library.available() \
            and 1 <= rows <= gemv_cpu.bf16_rows_max():
        return torch.bfloat16
    return product_dtype(x_dtype, device, rows)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K]; weight: [N, K]; returns [..., N] in x's dtype
    # Kernels get x as [M, K]: for a 3-D input whose leading strides it does not fold (a prefill's last
    # position, h[:, -1:] of [1, T, C]), torch.matmul broadcasts the weight to a batch and copies it, which
    # for gemma3's 262144 x 640 lm_head was a 335 MB transposing copy per call, most of a 512-token prefill.
    lead = x.shape[:-1]
    y = _linear_2d(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
    return y.view(*lead, y.shape[-1])


def _linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if gemv_cpu.bf16_supported(x, weight):
        return gemv_cpu.bf16_gemv(x, weight, bias)
    if x.shape[0] == 1 and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        return _without_onednn(x, weight, bias)
    dtype = product_dtype(x.dtype, x.device, x.shape[0])
    if dtype != x.dtype:
        return _widened(x, weight, bias, dtype)
    return F.linear(x, weight, bias)


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

