"""CPU fast path for 4-bit weights: PyTorch's int4 weight-only matmul for CPU (AVX-512/AVX2 kernels). A
single row goes to ``gemv_cpu``'s C kernel instead where it is built, and so do up to ``gemv_cpu.ROWS_MAX["int4"]``
rows where its AVX512-VNNI loop over tiles applies (batch-invariant, where this kernel's sums depend on M); this one
takes the other calls of fewer than ``max_rows`` rows.

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, scales_and_zeros)`` computes ``x @ W^T`` with
``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` (``g = k // G``), reading 4-bit codes and unpacking
them in registers, so decode streams half a byte per weight instead of two. qinfer's format maps onto it
exactly up to the scales' dtype: ``(q - z) * s = (q - 8) * s + (8 - z) * s``, so ``zero = (8 - z) * s``
(0 for symmetric weights, whose implicit z is 8). Scales and zeros are cast to the activation dtype
(bf16 scales carry 8 mantissa bits against fp16's 11: a relative change of at most 2^-9 per group, far
below 4-bit rounding noise; the tests bound it). With a bias (Qwen2's q/k/v) the same scales multiply fp32
activations, so the bias is added to the fp32 sum before the one rounding to the activations' dtype, as
``gemv_cpu``'s C kernel adds it to one row's.

The kernel's layout is converted once per weight at first use (``_convert_weight_to_int4pack_for_cpu``)
and cached beside the weight; ``int4_linear_ref`` is the plain-torch definition it is tested against.

It takes fewer than ``max_rows(x.dtype)`` rows: a decode step or a short prompt. The kernel multiplies in
fp32 and reads each weight once per call, which is what a few rows want; a longer prompt is compute-bound,
and there dequantizing the weight (``gemv_cpu``'s C loop) and handing it to oneDNN's GEMM is faster, so
``quant_linear`` sends those rows to the dequantize-then-matmul path. Where the GEMM runs in bf16 or fp16 (AMX
or AVX-512 bf16) that is from ``MAX_ROWS`` = 32 rows on; where it runs in fp32 (fp32 activations, or a CPU
without native half GEMMs: ``qinfer.kernels.dense``) from ``MAX_ROWS_FP32`` = 128 on, the fp32 GEMM being the
slower. ``python -m qinfer.evals.diagnostics.prefill_bench MODEL`` times both paths side by side; the timings
these limits come from are in docs/results.md ("The main job" for the bf16 GEMM, "Figures formerly in code
comments" for the fp32 one and the dequantize alone).
"""

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from qinfer.format import QuantizedWeight
from qinfer.kernels import dense
from qinfer.kernels.prepared import per_weight

GROUP_SIZES = (32, 64, 128, 256)
MAX_ROWS = 32  # from this many rows on, dequantize + a bf16 or fp16 GEMM is faster
MAX_ROWS_FP32 = 128  # ... + an fp32 GEMM
MATMUL_DTYPE = torch.float32  # the kernel widens activations and unpacked weights to fp32 and multiply-adds in fp32
_PACKED: dict[int, tuple[torch.Tensor, dict[torch.dtype, torch.Tensor]]] = {}


@dataclasses.dataclass
class Limit:
    """``rows``: the row count from which prompts take the dequantize-then-GEMM path whatever the dtype; None (the
    default) lets ``max_rows`` choose by dtype. Set only inside ``rows_limit``."""

    rows: int | None = None


LIMIT = Limit()


def max_rows(dtype: torch.dtype) -> int:
    """Rows of ``dtype`` from which on the dequantize-then-GEMM path is faster than this kernel."""
    if LIMIT.rows is not None:
        return LIMIT.rows
    return MAX_ROWS if dtype != torch.float32 and dense.native_half_gemm(dtype) else MAX_ROWS_FP32


@contextlib.contextmanager
def rows_limit(rows: int):
    """Inside it, ``max_rows`` is ``rows`` whatever the dtype (a side-by-side timing of the two paths: 0 sends
    every prompt to the dequantize-then-GEMM path, a large number every prompt to the kernel)."""
    prior, LIMIT.rows = LIMIT.rows, rows
    try:
        yield
    finally:
        LIMIT.rows = prior


def supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    N, K = weight.shape
    return (
        x.device.type == "cpu"
        and x.numel() < max_rows(x.dtype) * x.shape[-1]
        and weight.bits == 4
        and weight.group_size in GROUP_SIZES
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and N % 16 == 0
        and K % weight.group_size == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def _scales_and_zeros(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    scale = weight.scale.float()  # [N, K/G]
    zero = torch.zeros_like(scale) if weight.zero is None else (8 - weight.zero.float()) * scale
    return torch.stack([scale.T, zero.T], dim=-1).to(dtype).contiguous()  # [K/G, N, 2]


def _packed(weight: QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    packed, sz = per_weight(_PACKED, weight, _convert)
    if dtype not in sz:
        sz[dtype] = _scales_and_zeros(weight, dtype)
    return packed, sz[dtype]


def _convert(weight: QuantizedWeight) -> tuple[torch.Tensor, dict[torch.dtype, torch.Tensor]]:
    # the kernel's packed codes, and its scales/zeros per activation dtype (filled on first use)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes().to(torch.int32), 1), {}


def int4_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K] -> [..., N]; caller checked supported(x, weight)
    packed, sz = _packed(weight, x.dtype)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if bias is not None:  # the kernel's fp32 sum, the bias added to it and then one rounding to x's dtype
        rows, sz = rows.float(), sz.float()  # the same scales and zeros; x.float() is exact
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, weight.group_size, sz)
    if bias is not None:
        y = (y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def int4_linear_ref(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in plain torch, with the kernel's scale/zero form in fp32."""
    sz = _scales_and_zeros(weight, x.dtype).float()  # [K/G, N, 2]
    G = weight.group_size
    w = (weight.codes().float() - 8) * sz[..., 0].T.repeat_interleave(G, 1) + sz[..., 1].T.repeat_interleave(G, 1)
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
