"""Kernels: the entry points the model calls, each dispatching to a Triton kernel on CUDA, a CPU fast path
on CPU, or the pure-torch reference. Nothing here knows about models."""

from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.kernels.attention import attention
from qinfer.kernels.linear import linear, matmul_dtype, register
from qinfer.kernels.norm import rms_norm
from qinfer.kernels.quant_linear import fp8_linear, fp8_linear_dtype, quant_linear, quant_linear_dtype

register(QuantizedWeight, quant_linear, quant_linear_dtype)
register(Fp8Weight, fp8_linear, fp8_linear_dtype)

__all__ = ["attention", "linear", "matmul_dtype", "rms_norm"]
