"""Linear kernels for packed weights.

``dequant_linear_ref`` dequantizes the whole weight, then runs a dense matmul: correct for every format
and device, and the definition the fast kernels are tested against, but it materialises the dense weight
on every call. ``quant_linear`` is the entry point: on a GPU the Triton dequant-matmul (``triton_matmul``);
on CPU, for a decode step's row (or up to ``gemv_cpu.ROWS_MAX`` of them: 4-bit batches where its AVX512-VNNI
loop over tiles applies) of integer weights, ``gemv_cpu``'s C kernel where it is built; else
the int4 kernel where it applies (fewer than ``int4_cpu.max_rows`` rows), else for one bf16 row the int8
kernel (other bit widths), else the reference, which is also a long prefill's fast path: a GEMM in the
activations' dtype (in fp32 on a CPU without native bf16 GEMMs: ``qinfer.kernels.dense``), after
dequantizing the codes in ``gemv_cpu``'s C loops where they are built (the same weight, several times as fast
as the reference's PyTorch ops per gemma3 linear, 3-bit codes the most: ``python -m
qinfer.evals.diagnostics.prefill_bench MODEL``, figures in docs/results.md, "The main job"; FP8 codes likewise);
``quant_linear_dtype`` says which dtype the chosen kernel multiplies in. ``fp8_linear`` is FP8's: on a GPU
the same Triton kernel; on CPU for up to ``gemv_cpu.ROWS_MAX["fp8"]`` rows ``gemv_cpu``'s, else ``fp8_cpu``'s
one-row path where it applies, else the reference. A weight with permuted columns (``perm``: an imported act-order
checkpoint) hands the fast kernels ``x[..., perm]``.
"""

import torch

from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.kernels import fp8_cpu, gemv_cpu, int4_cpu, int8_cpu
from qinfer.kernels.dense import dense_linear, product_dtype


def dequant_linear_ref(x: torch.Tensor, weight: QuantizedWeight | Fp8Weight, bias: torch.Tensor | None = None):
    # x: [..., K]; weight: packed [N, K]; returns [..., N] in x's dtype
    return dense_linear(x, weight.dequantize(x.dtype), bias)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None):
    if _on_triton(x.device):
        from qinfer.kernels import triton_matmul  # triton is imported only where its kernels run

        return triton_matmul.dequant_matmul(_stored_order(x, weight), weight, bias)
    if gemv_cpu.int_supported(x, weight):
        return gemv_cpu.int_gemv(_stored_order(x, weight), weight, bias)
    if int4_cpu.supported(x, weight):
        return int4_cpu.int4_linear(_stored_order(x, weight), weight, bias)
    if int8_cpu.supported(x, weight):
        return int8_cpu.int8_linear(_stored_order(x, weight), weight, bias)
    if gemv_cpu.dequantize_supported(weight, x.dtype):  # the reference's dequantize, in C: the same weight
        return dense_linear(_stored_order(x, weight), gemv_cpu.dequantize(weight, x.dtype), bias)
    return dequant_linear_ref(x, weight, bias)


def _on_triton(device: torch.device) -> bool:
    return device.type == "cuda"


def _stored_order(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    # the kernels multiply the stored columns, which hold the input channels in the order weight.perm gives
    return x if weight.perm is None else x.index_select(-1, weight.perm)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None):
    if _on_triton(x.device):
        from qinfer.kernels import triton_matmul

        return triton_matmul.dequant_matmul(x, weight, bias)
    if gemv_cpu.fp8_supported(x, weight):
        return gemv_cpu.fp8_gemv(x, weight, bias)
    if fp8_cpu.supported(x, weight):
        return fp8_cpu.fp8_linear(x, weight, bias)
    if gemv_cpu.fp8_dequantize_supported(weight, x.dtype):  # the reference's dequantize, in C: the same weight
        return dense_linear(x, gemv_cpu.fp8_dequantize(weight, x.dtype), bias)
    return dequant_linear_ref(x, weight, bias)


def quant_linear_dtype(weight: QuantizedWeight, x_dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    if _on_triton(device):
        return torch.float32  # triton_matmul sums fp32 products (tf32 tensor cores for half inputs, exact there)
    x = torch.empty(1, 1, dtype=x_dtype, device=device).expand(rows, weight.shape[1])  # the shape, no memory
    if int4_cpu.supported(x, weight) or gemv_cpu.int_supported(x, weight):
        return int4_cpu.MATMUL_DTYPE  # fp32, as gemv_cpu's
    return product_dtype(x_dtype, device, rows)


def fp8_linear_dtype(weight: Fp8Weight, x_dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    if _on_triton(device):
        return torch.float32  # triton_matmul, as for integer weights
    return product_dtype(x_dtype, device, rows)
