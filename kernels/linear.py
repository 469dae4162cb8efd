"""The linear entry point the model calls: ``y = x @ W^T + b`` for whatever form ``W`` is stored in.

A plain tensor goes to ``dense``; a packed integer weight (``QuantizedWeight``) or an FP8 one (``Fp8Weight``)
to ``quant_linear``, which picks the Triton kernel on a GPU, a CPU fast path on CPU, or the reference.
``matmul_dtype`` names the dtype the chosen kernel multiplies in, which MFU takes its ceiling from.
"""

import torch

from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.kernels import gemv_cpu
from qinfer.kernels.dense import dense_dtype, dense_linear
from qinfer.kernels.quant_linear import fp8_linear, fp8_linear_dtype, quant_linear, quant_linear_dtype


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K]; weight: [N, K] dense or packed; returns [..., N] in x's dtype
    if isinstance(weight, torch.Tensor):
        return dense_linear(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        kernel = quant_linear
    elif isinstance(weight, Fp8Weight):
        kernel = fp8_linear
    else:
        raise TypeError(f"no linear kernel for weights of type {type(weight).__name__}")
    # the packed kernels take x as [M, K] (see ``dense_linear`` for why the view, not torch.matmul's broadcast)
    lead = x.shape[:-1]
    y = kernel(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
    return y.view(*lead, y.shape[-1])


def rowwise(x: torch.Tensor, weight) -> bool:
    """Whether ``linear(x, weight)`` sums each output of each row on its own, the same whatever the other rows and
    output rows are: one row, or rows the C GEMVs take (``gemv_cpu``: each row bit for bit what it gives alone)."""
    if x.numel() == x.shape[-1]:
        return True
    if isinstance(weight, torch.Tensor):
        return gemv_cpu.bf16_supported(x, weight)
    if isinstance(weight, QuantizedWeight):
        return gemv_cpu.int_supported(x, weight)
    return isinstance(weight, Fp8Weight) and gemv_cpu.fp8_supported(x, weight)


def matmul_dtype(weight, x_dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    """The dtype ``linear(x, weight)`` multiplies in for ``rows`` rows of ``x`` of ``x_dtype`` on ``device``."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear_dtype(weight, x_dtype, device, rows)
    if isinstance(weight, Fp8Weight):
        return fp8_linear_dtype(weight, x_dtype, device, rows)
    return dense_dtype(weight, x_dtype, device, rows)
