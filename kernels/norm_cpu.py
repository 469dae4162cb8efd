"""A decode step's few rows of RMSNorm in one C call (``qinfer_rms_norm`` in ``gemv_cpu.c``, built and loaded by
``cpu_library``), on an x86-64 CPU.

PyTorch's path for a row is a dozen small ops, and at a decode step's size their dispatch, not their arithmetic,
is what the step pays for. The C loop computes ``qinfer.kernels.norm.rms_norm_ref``'s roundings in one call: the
mean of squares in fp32, then either Gemma's ``x / rms(x) * (offset + w)`` in fp32, rounded once, or Llama's
``x / rms(x)`` rounded to x's dtype, then times ``w``. It takes up to ``NORM_MAX_ROWS`` rows (copied first where
they are not contiguous: a query head's slice of a fused q/k/v output), eagerly and outside
``cpu_library.only_gemvs``: a long prefill's rows go to PyTorch's vectorised, multi-threaded ops, and a compiled
graph fuses the norm with its neighbours itself. Inside :func:`all_rows` (an engine step's decode rows) it takes
any number of rows, so a row's norm is the same whatever else runs in the step (the engine's batch invariance:
the C loop and PyTorch's ops round alike but sum in other orders). Under the profiler the call is the operator
``torch.ops.qinfer.rms_norm``, so ``decode_profile`` names it; other calls skip its dispatch.
"""

import contextlib

import torch
from torch.autograd import profiler

from qinfer.kernels import cpu_library
from qinfer.kernels.cpu_library import DTYPE_CODES, OPS

NORM_MAX_ROWS = 16  # more rows (a prefill's) go to PyTorch's vectorised, multi-threaded ops
_LIMIT = [NORM_MAX_ROWS]


@contextlib.contextmanager
def all_rows():
    """Inside it, the C loop takes every row count (decode rows of many sequences, each normed as alone)."""
    before, _LIMIT[0] = _LIMIT[0], 1 << 62
    try:
        yield
    finally:
        _LIMIT[0] = before


def rows_max() -> int:
    """The most rows the C loop takes now: ``NORM_MAX_ROWS``, or any number inside :func:`all_rows`."""
    return _LIMIT[0]


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, scale_in_fp32: bool) -> bool:
    """Up to ``NORM_MAX_ROWS`` rows (any number inside :func:`all_rows`) of RMSNorm (``qinfer.kernels.norm``), eagerly: a compiled graph fuses the
    norm with its neighbours itself."""
    return (
        x.is_cpu and weight.is_cpu and x.dtype in DTYPE_CODES and weight.dtype in DTYPE_CODES
        and weight.dim() == 1 and x.shape[-1] == weight.numel() and 0 < x.numel() <= _LIMIT[0] * x.shape[-1]
        and weight.is_contiguous() and (scale_in_fp32 or weight.dtype == x.dtype)
        and cpu_library.row_loop_allowed(x, weight)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_fp32: bool) -> torch.Tensor:
    """``qinfer.kernels.norm.rms_norm_ref`` in C, for inputs :func:`rms_norm_supported` accepts."""
    if profiler._is_profiler_enabled:
        return torch.ops.qinfer.rms_norm(x, weight, eps, offset, scale_in_fp32)
    return _rms_norm_op(x, weight, eps, offset, scale_in_fp32)


def _rms_norm_op(x, weight, eps: float, offset: float, scale_in_fp32: bool) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    D = x.shape[-1]
    cpu_library.library()[0].qinfer_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // D, D, eps,
                                             offset, DTYPE_CODES[x.dtype], DTYPE_CODES[weight.dtype],
                                             int(scale_in_fp32))
    return y


OPS.define("rms_norm(Tensor x, Tensor weight, float eps, float offset, bool scale_in_fp32) -> Tensor")
OPS.impl("rms_norm", _rms_norm_op, "CPU")


@torch.library.register_fake("qinfer::rms_norm")
def _(x, weight, eps, offset, scale_in_fp32):
    return torch.empty_like(x)
