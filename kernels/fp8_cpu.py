"""CPU path for one row times an FP8 (E4M3) weight: a decode step at batch 1, where ``gemv_cpu``'s C kernel
is not built (no C compiler, no AVX2, ``QINFER_CPU_GEMV=0``).

PyTorch converts float8 to other dtypes one element at a time, so dequantizing an FP8 weight on every call
cost many times a bf16 GEMV (docs/results.md, "Figures formerly in code comments"). An E4M3 code is exactly an
fp16 number scaled by 2^8 once its bits move (``qinfer.format.e4m3_as_fp16``, three integer passes); ATen's fp16
GEMV (fp32 accumulation) multiplies that fp16 weight.

The row is divided by its largest magnitude before it is rounded to fp16, so it cannot overflow fp16 and
keeps fp16's 11-bit mantissa (bf16 has 8); each output is then at most ``K * 448 / 2^8`` in magnitude (fp16
holds 65504, hence ``K <= MAX_K``). The row's magnitude, 2^8 and the weight's scales multiply the fp32
result. Against a float64 product the error is the bf16 rounding of the output, below the reference
dequantize-then-matmul's (which rounds every ``code * scale`` to bf16 first).

fp32 rows and many rows (a prefill) take the reference: a fp16 GEMM was far slower than a bf16 one where
this was measured (same section of docs/results.md).

Under ``torch.compile`` the move into fp16 is one opaque operator, ``torch.ops.qinfer.e4m3_as_fp16``:
inductor would otherwise fuse its three integer passes into one scalar C++ loop (its float8 bit casts do not
vectorise), and gemma3-270m's compiled FP8 decode step was then slower than the eager one (``python -m
qinfer.evals.diagnostics.decode_profile MODEL --compile`` times both; docs/results.md, "Figures formerly in code
comments"). The rest of the path (the row's scaling, the GEMV, the
output's scales) stays in the graph for inductor. Eager calls skip the operator's dispatch.
"""

import torch
import torch.nn.functional as F

from qinfer.format import FP8_MAX, FP8_SHIFT, Fp8Weight, e4m3_as_fp16

MAX_K = int(torch.finfo(torch.float16).max * FP8_SHIFT / FP8_MAX)  # longest row whose outputs fit fp16
# activations whose own rounding is no finer than fp16's; fp32 rows keep the reference's fp32 product
HALF_DTYPES = (torch.bfloat16, torch.float16)


def supported(x: torch.Tensor, weight: Fp8Weight) -> bool:
    one_row = x.numel() == x.shape[-1]
    return x.device.type == "cpu" and one_row and weight.shape[1] <= MAX_K and x.dtype in HALF_DTYPES


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K] holding one row; returns [..., N] in x's dtype; caller checked supported(x, weight)
    as_fp16 = codes_as_fp16 if torch.compiler.is_compiling() else e4m3_as_fp16
    row = x.reshape(1, -1).float()
    norm = row.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    y = F.linear((row / norm).half(), as_fp16(weight.weight)).float()  # [1, N]
    y = y * (weight.scale.reshape(1, -1) * (norm * FP8_SHIFT))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


# torch.ops.qinfer.e4m3_as_fp16: a CPU kernel registered through torch.library.Library, whose dispatch costs
# less a call than through torch.library.custom_op (126 calls a gemma3 decode step; docs/results.md, "Figures
# formerly in code comments")
_LIBRARY = torch.library.Library("qinfer", "DEF")
_LIBRARY.define("e4m3_as_fp16(Tensor codes) -> Tensor")
_LIBRARY.impl("e4m3_as_fp16", e4m3_as_fp16, "CPU")


@torch.library.register_fake("qinfer::e4m3_as_fp16")
def _(codes):
    return torch.empty_like(codes, dtype=torch.float16)


codes_as_fp16 = torch.ops.qinfer.e4m3_as_fp16
