"""CPU path for one row times an FP8 (E4M3) weight: a decode step at batch 1.

PyTorch converts float8 to other dtypes one element at a time (~2 ns each here), so dequantizing an
FP8 weight on every call cost 10x a bf16 GEMV. An E4M3 code is exactly an fp16 number scaled by 2^8 once its
bits move (``qinfer.format.e4m3_as_fp16``, three integer passes); ATen's fp16 GEMV (fp32 accumulation)
multiplies that fp16 weight.

The row is divided by its largest magnitude before it is rounded to fp16, so it cannot overflow fp16 and
keeps fp16's 11-bit mantissa (bf16 has 8); each output is then at most ``K * 448 / 2^8`` in magnitude (fp16
holds 65504, hence ``K <= MAX_K``). The row's magnitude, 2^8 and the weight's scales multiply the fp32
result. Against a float64 product the error is the bf16 rounding of the output, below the reference
dequantize-then-matmul's (which rounds every ``code * scale`` to bf16 first).

fp32 rows and many rows (a prefill) take the reference: a fp16 GEMM was 6x slower than a bf16 one here.

Under ``torch.compile`` the kernel is one opaque operator, ``torch.ops.qinfer.fp8_gemv``: inductor would
otherwise fuse the three integer passes into one scalar C++ loop (its float8 bit casts do not vectorise),
and gemma3-270m's compiled FP8 decode step took 95.8 ms against 76.3 eager; as one operator, 67.1 against
76.7 (``python -m qinfer.evals.decode_profile MODEL --compile``). Eager calls skip the operator's dispatch.
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
    gemv = fp8_gemv if torch.compiler.is_compiling() else _fp8_gemv
    y = gemv(x.reshape(1, -1), weight.weight, weight.scale, bias)  # [1, N]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _fp8_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [1, K]; codes: float8_e4m3fn [N, K]; scale: fp32 [N, 1] or [1]; returns [1, N] in x's dtype
    row = x.float()
    norm = row.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    y = F.linear((row / norm).half(), e4m3_as_fp16(codes)).float()
    y = y * (scale.reshape(1, -1) * (norm * FP8_SHIFT))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


fp8_gemv = torch.library.custom_op("qinfer::fp8_gemv", _fp8_gemv, mutates_args=())


@fp8_gemv.register_fake
def _(x, codes, scale, bias):
    return x.new_empty(1, codes.shape[0])
