"""A decode step's decoder layers in one C call (``qinfer_decode_layers`` in ``decode_cpu.c``, built with
``gemv_cpu.c`` by ``cpu_library``), on an x86-64 CPU.

At batch 1 a small model's decode step reads a few MB of weights, which the C GEMVs stream in a few
milliseconds; the step's other ops (per layer two to four norms, the RoPE, the KV-cache write, the attention,
the residual adds, the activation, and the views, checks and wrappers around each) are a hundred or more
PyTorch and ctypes calls a layer, whose dispatch cost as much again. ``qinfer_decode_layers`` runs every layer
for M rows (tokens, each of its own sequence and position) in one call: the same C kernels the eager path
calls (``qinfer_rms_norm``, the bf16, integer and FP8 GEMVs, ``qinfer_paged_decode_attention``) on the same
inputs, and between them the eager path's elementwise ops computed as PyTorch computes them on 16-bit tensors
(fp32, rounded once per op), the gate's activation read from :func:`activation_table`: its outputs are the
eager path's bit for bit. ``qinfer.model.decode_plan`` fills the structs below (once per model and per cache)
and decides when the call applies; this module knows nothing of models.

Structs (``decode_cpu.c`` holds the same fields): :class:`Linear` (a prepared ``gemv_cpu.Weight``, its bias
and kernel), :class:`Norm`, :class:`Layer`, :class:`Model` and, per call, :class:`Step`. Under the profiler
the call is named ``qinfer::decode_layers``.
"""

import ctypes

import torch
import torch.nn.functional as F
from torch.autograd import profiler

from qinfer.kernels import cpu_library
from qinfer.kernels.gemv_cpu import Weight

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KINDS = {"bf16": 0, "int": 1, "fp8": 2}  # which GEMV a Linear calls
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


class Linear(ctypes.Structure):
    _fields_ = [("w", ctypes.POINTER(Weight)), ("bias", _P), ("kind", _I64)]


class Norm(ctypes.Structure):
    _fields_ = [("w", _P), ("eps", _F), ("offset", _F), ("wdtype", _I64), ("scale_in_fp32", _I64)]


class Layer(ctypes.Structure):
    _fields_ = ([(name, Norm) for name in ("input", "post_attention", "pre_feedforward", "post_feedforward", "q",
                                           "k")]
                + [(name, Linear) for name in ("qkv", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up", "gate",
                                               "up", "down")]
                + [("rope", _I64), ("window", _I64), ("scale", _F)])


class Model(ctypes.Structure):
    _fields_ = ([(name, _I64) for name in ("L", "C", "H", "Hkv", "D", "F", "dtype", "sandwich")]
                + [("act", _P), ("final_norm", Norm), ("layers", ctypes.POINTER(Layer))])


class Step(ctypes.Structure):
    _fields_ = [("M", _I64), ("x", _P), ("out", _P), ("slots", _P), ("table", _P), ("tb", _I64), ("P", _I64),
                ("ends", _P), ("starts", ctypes.POINTER(_P)), ("cos", ctypes.POINTER(_P)),
                ("sin", ctypes.POINTER(_P)), ("cs", _I64), ("k_pages", ctypes.POINTER(_P)),
                ("v_pages", ctypes.POINTER(_P))]


def activation_table(act: str, dtype: torch.dtype) -> torch.Tensor:
    """``act(x)`` in ``dtype`` (bf16 or fp16) at each of its 65536 bit patterns x, indexed by them: the gate
    activation as PyTorch's own op computes it (``F.silu``, ``F.gelu``), so a lookup gives its bits."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)  # entry i: the bits of i
    if act == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def norm(weight: torch.Tensor, eps: float, offset: float, scale_in_fp32: bool) -> Norm:
    """An RMSNorm as ``qinfer_rms_norm`` takes it (``qinfer.kernels.norm``); ``weight`` contiguous, kept alive by
    the caller."""
    return Norm(weight.data_ptr(), eps, offset, cpu_library.DTYPE_CODES[weight.dtype], int(scale_in_fp32))


def decode_layers(model: Model, step: Step) -> None:
    """Run ``step``'s rows through every layer of ``model`` and its final norm (``decode_cpu.c``)."""
    if profiler._is_profiler_enabled:
        with torch.profiler.record_function("qinfer::decode_layers"):
            failed = cpu_library.library()[0].qinfer_decode_layers(ctypes.byref(model), ctypes.byref(step))
    else:
        failed = cpu_library.library()[0].qinfer_decode_layers(ctypes.byref(model), ctypes.byref(step))
    if failed:
        raise MemoryError("out of memory for a decode step's scratch")


def argmax_supported(logits: torch.Tensor) -> bool:
    """Rows of logits [M, V] on CPU (each row contiguous, V > 0, fp32, bf16 or fp16), eagerly, the library built."""
    return (
        logits.dim() == 2 and logits.is_cpu and logits.dtype in cpu_library.DTYPE_CODES and logits.shape[1] > 0
        and logits.stride(1) == 1 and not torch.compiler.is_compiling() and cpu_library.available()
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[M] int64: each row's ``torch.max(dim=-1).indices`` (the first of a tie, the first NaN where a row holds
    one), in one C pass over a row or two where PyTorch's reduction over a vocabulary of bf16 logits is several
    times slower; for logits :func:`argmax_supported` accepts."""
    M, V = logits.shape
    out = torch.empty(M, dtype=torch.int64)
    run = cpu_library.library()[0].qinfer_argmax
    if profiler._is_profiler_enabled:
        with torch.profiler.record_function("qinfer::argmax"):
            run(logits.data_ptr(), M, V, logits.stride(0), cpu_library.DTYPE_CODES[logits.dtype], out.data_ptr())
    else:
        run(logits.data_ptr(), M, V, logits.stride(0), cpu_library.DTYPE_CODES[logits.dtype], out.data_ptr())
    return out
