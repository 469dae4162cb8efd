"""Kernels: the entry points the model calls, each dispatching to a Triton kernel on CUDA, a CPU fast path
on CPU, or the pure-torch reference. Nothing here knows about models."""

from qinfer.kernels.attention import attention
from qinfer.kernels.linear import linear

__all__ = ["attention", "linear"]
