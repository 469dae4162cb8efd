"""One activation row times a bf16, integer (2, 3, 4, 8 bits) or FP8 weight on an x86-64 CPU: a decode step's
GEMV, in C.

Decode at batch 1 reads every weight once per token, so its linears should stream at the memory bandwidth.
PyTorch's own one-row kernels do not on a CPU with AVX2 only: ATen's bf16 GEMV widens and sums at ~9 GB/s a core
(gemma3-270m's 335 MB lm_head: ~19 ms a step on 2 cores, about 60% of the bandwidth the roofline measures); its
int4 weight-only kernel (``int4_cpu``) takes ~115 us for a 2048 x 640 weight of 0.7 MB; 2-, 3- and 8-bit codes went
through one int8 matmul per group (``int8_cpu``) and FP8 codes through an fp16 copy of the weight (``fp8_cpu``).
``gemv_cpu.c`` does each product in one pass over the stored bytes with AVX2/FMA/F16C: bf16 bits move into fp32 in
registers; 4-bit codes are unpacked in registers, their nibbles meeting the row's even and odd entries (on a CPU
with AVX-VNNI or AVX512-VNNI, groups of 64 or more, bf16 or fp16 rows: as bytes in integer dot products,
VPDPBUSD, against x in 15-bit fixed point per group, exact integer sums scaled once a group, within max|x in the
group| / 32766 of each x where bf16 keeps 2^-9 of x itself; an fp32 row keeps the float loop); 2- and 3-bit codes,
8 to a 16- or 24-bit word, by a shift per lane; integer codes are summed against x per group and scaled once
(``s * (sum q x - z * sum x)``; a group whose codes all equal its zero point is given scale 0, so it gives exactly 0
where the two sums would leave a residue times its scale); E4M3 codes move into fp16 bits (sign-extended, shifted,
masked: exact, subnormals too) and F16C widens them. Rows split across OpenMP threads (PyTorch's own runtime:
``torch.set_num_threads``).
Every product and sum is fp32 (the VNNI loop's are exact integers until each group's is scaled) and each output is
rounded once to the row's dtype, a bias (Qwen2's q/k/v) added in fp32 before that, as PyTorch's ``linear`` adds
it: the references' results up to the order of their sums (and the VNNI loop's fixed-point x), except where the
zero term cancels most of ``sum q x`` (x far from zero mean over a long group: fp32 rows then differ from the
reference by up to ~1e-4 of the output where the reference's own error is ~1e-7).
``python -m qinfer.evals.diagnostics.gemv_bench MODEL`` times each against PyTorch's path side by side
(``docs/RESULTS-LOG.md``).

Two more row loops of a decode step live here, for the same reason in another form: PyTorch's dispatch of a
dozen small ops costs more than their arithmetic. ``rms_norm`` (``qinfer.kernels.norm``) normalises a few rows
in one call, ``decode_attention`` (``qinfer.kernels.attention``) runs one query row per head over a KV cache's
slice without fp32 copies of the keys and values (a quantized cache's int8 or E4M3 codes as stored, its
scales folded into the queries, scores and sums). Both are eager only (a compiled graph fuses these ops itself).
And a prompt's GEMM needs its packed weights dense: ``dequantize`` and ``fp8_dequantize`` write an integer or
FP8 weight out in the activations' dtype, the format's own numbers bit for bit, in one pass 4-19x as fast as its
PyTorch ops (``python -m qinfer.evals.diagnostics.prefill_bench MODEL``).

The C source is compiled at first use with the system's C compiler into ``<cache>/kernels`` (half a second;
the file name carries a hash of the source, flags and compiler) and loaded with ``ctypes``. Without a
compiler, on a CPU without AVX2, or with ``QINFER_CPU_GEMV=0`` in the environment, ``available()`` is False
(``unavailable_reason()`` says why) and the callers keep PyTorch's kernels. Under ``torch.compile``, and
under the profiler (so ``decode_profile`` names them), the kernels are called as the operators
``torch.ops.qinfer.bf16_gemv``, ``int_gemv`` and ``fp8_gemv``, opaque to inductor; other eager calls skip
their dispatch.
"""

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch.autograd import profiler

from qinfer.store.cache import cache_dir, sha256_file, temp_path, write_atomic
from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.kernels.prepared import per_weight, zero_groups

SOURCE = Path(__file__).with_name("gemv_cpu.c")
# read once, with this module: the library is built from (and keyed by) the C this module's calls were written for,
# even if the file changes while a process runs (None: unreadable, and the callers keep PyTorch's kernels)
_SOURCE_BYTES = SOURCE.read_bytes() if SOURCE.is_file() else None
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KV_CODES = {torch.int8: 3, torch.float8_e4m3fn: 4}  # a quantized KV cache's keys and values
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclasses.dataclass
class Switches:
    """Which of this module's kernels the callers take, for side-by-side timings; each is set only inside its
    context manager below (``disabled``, ``only_gemvs``, ``pytorch_dequantize``)."""

    disabled: bool = False  # every caller takes PyTorch's kernels
    only_gemvs: bool = False  # RMSNorm and decode attention take PyTorch's ops; the GEMVs stay in C
    no_dequantize: bool = False  # a prompt's packed weights are dequantized by the format's PyTorch ops


SWITCHES = Switches()
_PREPARED: dict[str, dict] = {"bf16": {}, "int": {}, "fp8": {}}  # per_weight stores: (data pointers, Weight)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels, or None and why not."""
    if os.environ.get("QINFER_CPU_GEMV", "1") == "0":
        return None, "QINFER_CPU_GEMV=0"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU's vector capability is {torch.backends.cpu.get_cpu_capability()}, not AVX2"
    if _SOURCE_BYTES is None:
        return None, f"{SOURCE} is missing"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None, "no C compiler (gcc or $CC)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(_SOURCE_BYTES + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
        path = cache_dir() / "kernels" / f"gemv_cpu-{key}.so"
        if not _intact(path):  # not built yet, or damaged since (loading a truncated library can crash)
            failed = _build(cc, path)
            if failed:
                return None, failed
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building the CPU GEMV kernels failed: {e}"
    for kernel in (lib.qinfer_bf16_gemv, lib.qinfer_int4_gemv, lib.qinfer_int8_gemv, lib.qinfer_narrow_gemv,
                   lib.qinfer_fp8_gemv):
        kernel.argtypes, kernel.restype = [_P, _P, _P, _P, ctypes.c_int], ctypes.c_int
    lib.qinfer_rms_norm.argtypes = [_P, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_float] + [ctypes.c_int] * 3
    lib.qinfer_rms_norm.restype = None
    lib.qinfer_decode_attention.argtypes = ([_P] * 4 + [_I64] * 13 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
                                            + [_P] * 4 + [_I64] * 2)
    lib.qinfer_decode_attention.restype = ctypes.c_int
    for kernel in (lib.qinfer_int4_dequantize, lib.qinfer_int_dequantize, lib.qinfer_fp8_dequantize):
        kernel.argtypes, kernel.restype = [_P, _P, ctypes.c_int], ctypes.c_int
    lib.qinfer_int4_vnni.argtypes, lib.qinfer_int4_vnni.restype = [ctypes.c_int], ctypes.c_int
    return lib, ""


def _intact(path: Path) -> bool:
    """Whether ``path`` is the library :func:`_build` wrote: its sha256 is the one recorded beside it."""
    digest = path.with_suffix(".sha256")
    return path.is_file() and digest.is_file() and digest.read_text().strip() == sha256_file(path)


def _build(cc: str, path: Path) -> str:
    """Compile the kernels to ``path`` (atomically); '' or why it failed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path.parent, ".gemv_cpu-", folder=False)
    try:
        run = subprocess.run([cc, *FLAGS, "-x", "c", "-", "-o", str(tmp)], input=_SOURCE_BYTES, capture_output=True,
                             timeout=300)
        if run.returncode:
            return f"{cc} failed: {(run.stderr.decode(errors='replace').strip().splitlines() or ['?'])[-1]}"
        os.replace(tmp, path)
        write_atomic(path.with_suffix(".sha256"), sha256_file(path))
        return ""
    finally:
        tmp.unlink(missing_ok=True)


def available() -> bool:
    return not SWITCHES.disabled and _library()[0] is not None


# A traced graph keeps the path it was traced with: torch.compile takes available() as a constant. This is the mark
# torch.compiler.assume_constant_result sets (tests check it still is), set without importing torch._dynamo, which
# that function does: 150 MiB of memory and a second in every command that never compiles.
available._dynamo_marked_constant = True


@contextlib.contextmanager
def _switched(name: str):
    prior = getattr(SWITCHES, name)
    setattr(SWITCHES, name, True)
    try:
        yield
    finally:
        setattr(SWITCHES, name, prior)


@contextlib.contextmanager
def disabled():
    """Inside it, the callers take PyTorch's kernels (a side-by-side timing); eager calls only: a compiled
    graph keeps the path it was traced with."""
    with _switched("disabled"):
        yield


@contextlib.contextmanager
def only_gemvs():
    """Inside it, RMSNorm and a decode step's attention take PyTorch's ops and the GEMVs stay in C (a
    side-by-side timing of those two)."""
    with _switched("only_gemvs"):
        yield


@contextlib.contextmanager
def pytorch_dequantize():
    """Inside it, a prompt's packed weights are dequantized by the format's PyTorch ops, not the C loops (a
    side-by-side timing; the same bits either way)."""
    with _switched("no_dequantize"):
        yield


VNNI_LOOPS = {1: "AVX-VNNI", 2: "AVX512-VNNI"}  # qinfer_int4_vnni's numbers of the 4-bit VNNI loops


def int4_vnni() -> str:
    """Which VNNI loop 4-bit rows go through (integer dot products against x in 15-bit fixed point per group;
    groups of 64 or more): "AVX-VNNI" or "AVX512-VNNI" where the CPU has it, the compiler knew it, and
    :func:`without_vnni` is off; else "" (the AVX2 float loop)."""
    return VNNI_LOOPS.get(_library()[0].qinfer_int4_vnni(-1), "") if available() else ""


def vnni_loops() -> list[str]:
    """The VNNI loops this CPU can run (AVX-VNNI first: the one 4-bit rows take where it has both)."""
    loops = []
    for name in VNNI_LOOPS.values():
        with _vnni_loop(name) as taken:
            loops += [name] if taken else []
    return loops


@contextlib.contextmanager
def _vnni_loop(name: str):
    lib = _library()[0] if available() else None
    if lib is None:
        yield False
        return
    code = {v: k for k, v in VNNI_LOOPS.items()}.get(name, 0)
    prior = lib.qinfer_int4_vnni(code)
    try:
        yield lib.qinfer_int4_vnni(-1) == code
    finally:
        lib.qinfer_int4_vnni(prior)


def without_vnni():
    """Inside it, 4-bit rows take the AVX2 float loop even where the CPU has VNNI (a side-by-side timing)."""
    return _vnni_loop("")


def with_vnni(name: str):
    """Inside it, 4-bit rows take the VNNI loop ``name`` (one of :func:`vnni_loops`), as a test compares them."""
    if name not in vnni_loops():
        raise ValueError(f"this CPU has no {name} loop (it has: {', '.join(vnni_loops()) or 'none'})")
    return _vnni_loop(name)


def unavailable_reason() -> str:
    """Why the kernels are not in use ('' when they are)."""
    return _library()[1]


def describe() -> str:
    """What a decode step's one-row products run through on CPU, in a few words (``qinfer eval``'s reports)."""
    if not available():
        return f"PyTorch's one-row kernels ({unavailable_reason()})"
    return f"qinfer's C GEMVs (4-bit codes through {int4_vnni()})" if int4_vnni() else "qinfer's C GEMVs"


def _one_row(x: torch.Tensor, K: int) -> bool:
    return x.is_cpu and x.numel() == x.shape[-1] == K and x.dtype in _DTYPE_CODES


def bf16_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One bf16 row against a bf16 weight [N, K] whose rows are contiguous."""
    return (
        weight.dim() == 2 and _one_row(x, weight.shape[1]) and x.dtype == weight.dtype == torch.bfloat16
        and weight.is_cpu and weight.stride(1) == 1 and available()
    )


def int_supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """One row against 2-, 3-, 4- or 8-bit codes whose groups (or rows, per channel) are a multiple of 16 long."""
    group = weight.shape[1] if weight.group_size == -1 else weight.group_size
    return (
        _one_row(x, weight.shape[1]) and weight.bits in (2, 3, 4, 8) and group % 16 == 0
        and weight.qweight.is_cpu and available()
    )


NORM_MAX_ROWS = 16  # more rows (a prefill's) go to PyTorch's vectorised, multi-threaded ops


def _row_loop_allowed(*tensors: torch.Tensor) -> bool:
    """What the norm and attention loops need beyond their shapes: no gradient wanted (C has no autograd), an
    eager call (a compiled graph fuses these ops itself), not inside :func:`only_gemvs`, and the kernels built."""
    return (
        not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and not torch.compiler.is_compiling() and not SWITCHES.only_gemvs and available()
    )


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, scale_in_fp32: bool) -> bool:
    """A decode step's few contiguous rows of RMSNorm (``qinfer.kernels.norm``), eagerly: a compiled graph
    fuses the norm with its neighbours itself."""
    return (
        x.is_cpu and weight.is_cpu and x.dtype in _DTYPE_CODES and weight.dtype in _DTYPE_CODES
        and weight.dim() == 1 and x.shape[-1] == weight.numel() and 0 < x.numel() <= NORM_MAX_ROWS * x.shape[-1]
        and x.is_contiguous() and weight.is_contiguous() and (scale_in_fp32 or weight.dtype == x.dtype)
        and _row_loop_allowed(x, weight)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_fp32: bool) -> torch.Tensor:
    """``qinfer.kernels.norm.rms_norm_ref`` in C, for inputs :func:`rms_norm_supported` accepts."""
    if profiler._is_profiler_enabled:
        return torch.ops.qinfer.rms_norm(x, weight, eps, offset, scale_in_fp32)
    return _rms_norm_op(x, weight, eps, offset, scale_in_fp32)


def _rms_norm_op(x, weight, eps: float, offset: float, scale_in_fp32: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    D = x.shape[-1]
    _library()[0].qinfer_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // D, D, eps, offset,
                                  _DTYPE_CODES[x.dtype], _DTYPE_CODES[weight.dtype], int(scale_in_fp32))
    return y


def attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quantized: bool = False) -> bool:
    """A decode step's attention (``qinfer.kernels.attention``): one query row per head, q [B, H, 1, D] against
    k, v [B, Hkv, S, D] (a KV cache's slice: any strides but the last), one dtype (``quantized``: k and v int8 or
    E4M3 codes), D a multiple of 8; eagerly."""
    return (
        q.dim() == k.dim() == v.dim() == 4 and q.shape[2] == 1 and k.shape == v.shape and k.shape[2] > 0
        and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3] and q.shape[3] % 8 == 0
        and q.shape[1] % k.shape[1] == 0 and q.dtype in _DTYPE_CODES and k.dtype == v.dtype
        and (k.dtype in _KV_CODES if quantized else k.dtype == q.dtype)
        and q.is_cpu and k.is_cpu and v.is_cpu and q.stride(3) == k.stride(3) == v.stride(3) == 1
        and _row_loop_allowed(q, k, v)
    )


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for inputs :func:`attention_supported` accepts: [B, H, 1, D] in q's dtype.
    For int8 or E4M3 codes k, v, the keys are ``k * k_scale * k_pos`` and the values ``v * v_scale * v_pos``,
    in fp32: ``k_scale``, ``v_scale`` fp32 [Hkv, D], per KV head and channel ([Hkv], per head, is broadcast);
    ``k_pos``, ``v_pos`` fp32 [B, Hkv, S] (a cache's slice: any strides but the last, both alike), per position
    and KV head, or None. The channel scales are folded into the queries and the weighted sums, the position
    scales into the scores and the weights, never into a copy."""
    if profiler._is_profiler_enabled:
        return torch.ops.qinfer.decode_attention(q, k, v, scale, k_scale, v_scale, k_pos, v_pos)
    return _attention_op(q, k, v, scale, k_scale, v_scale, k_pos, v_pos)


def _attention_op(q, k, v, scale: float, k_scale=None, v_scale=None, k_pos=None, v_pos=None) -> torch.Tensor:
    B, H, _, D = q.shape
    out = torch.empty(B, H, 1, D, dtype=q.dtype)
    scales, pos = [None, None], [None, None]
    if k.dtype in _KV_CODES:  # (a KV cache's scales are fp32 [Hkv, D] already: no op per call)
        scales = [x if x.dtype == torch.float32 and x.shape == (k.shape[1], D) and x.is_contiguous()
                  else x.float().reshape(k.shape[1], -1).expand(-1, D).contiguous() for x in (k_scale, v_scale)]
        if k_pos is not None or v_pos is not None:  # a cache's slices: one layout for both, positions contiguous
            if k_pos is None or v_pos is None or not k_pos.shape == v_pos.shape == k.shape[:3]:
                raise ValueError(f"k_pos and v_pos must both be [B, Hkv, S] = {list(k.shape[:3])}, or both None")
            pos = [k_pos, v_pos]
            if not (k_pos.dtype == v_pos.dtype == torch.float32 and k_pos.stride() == v_pos.stride()
                    and k_pos.stride(2) == 1):
                pos = [x.float().contiguous() for x in pos]
    if _library()[0].qinfer_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, k.shape[1], k.shape[2], D, q.stride(0),
        q.stride(1), *k.stride()[:3], *v.stride()[:3], scale, _DTYPE_CODES[q.dtype],
        _KV_CODES.get(k.dtype, _DTYPE_CODES[q.dtype]), *(x.data_ptr() if x is not None else None for x in scales),
        *(x.data_ptr() if x is not None else None for x in pos),
        *(pos[0].stride()[:2] if pos[0] is not None else (0, 0)),
    ):
        raise MemoryError("out of memory for a decode step's attention scores")
    return out


class Weight(ctypes.Structure):
    """A weight as the C kernels read it (``qinfer_weight`` in gemv_cpu.c): pointers into tensors kept alive
    elsewhere (by the model), built once per weight (:func:`_prepared`)."""

    _fields_ = [("w", _P), ("scale", _P), ("zero", _P), ("N", _I64), ("K", _I64), ("ld", _I64), ("group", _I64),
                ("bits", _I64)]


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row ``x`` [..., K] and a bf16 ``weight`` [N, K]: [..., N] in x's dtype."""
    if torch.compiler.is_compiling() or profiler._is_profiler_enabled:
        return torch.ops.qinfer.bf16_gemv(x, weight, bias)
    return _bf16_op(x, weight, bias)


def fp8_supported(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """One row against E4M3 codes [N, K], K a multiple of 8, rows contiguous."""
    codes = weight.weight
    return (
        _one_row(x, weight.shape[1]) and weight.shape[1] % 8 == 0 and codes.is_cpu
        and codes.stride(1) == 1 and available()
    )


def int_gemv(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for one row ``x`` [..., K] (in ``weight``'s stored column order) and a 2-, 3-, 4- or
    8-bit ``weight``: [..., N] in x's dtype."""
    w = weight
    if torch.compiler.is_compiling() or profiler._is_profiler_enabled:
        return torch.ops.qinfer.int_gemv(x, w.qweight, w.scale, w.zero, w.bits, w.group_size, bias)
    return _int_op(x, w.qweight, w.scale, w.zero, w.bits, w.group_size, bias)


def fp8_gemv(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for one row ``x`` [..., K] and an FP8 ``weight``: [..., N] in x's dtype."""
    if torch.compiler.is_compiling() or profiler._is_profiler_enabled:
        return torch.ops.qinfer.fp8_gemv(x, weight.weight, weight.scale, bias)
    return _fp8_op(x, weight.weight, weight.scale, bias)


def _bf16_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    def build():
        return Weight(weight.data_ptr(), None, None, *weight.shape, weight.stride(0), 0)

    return _run(_library()[0].qinfer_bf16_gemv, x, _prepared(_PREPARED["bf16"], weight, (weight,), build), bias)


def _int_op(x, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int,
            bias: torch.Tensor | None = None):
    if not (qweight.is_contiguous() and scale.is_contiguous() and (zero is None or zero.is_contiguous())):
        qweight, scale, zero = (None if t is None else t.contiguous() for t in (qweight, scale, zero))
        # contiguous copies, prepared for this call only
        return _int_op(x, qweight, scale, zero, bits, group_size, bias)
    lib = _library()[0]
    kernel = lib.qinfer_int4_gemv if bits == 4 else lib.qinfer_int8_gemv if bits == 8 else lib.qinfer_narrow_gemv
    return _run(kernel, x, _int_weight(qweight, scale, zero, bits, group_size), bias)


def _int_weight(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                group_size: int) -> Weight:
    """The prepared Weight of contiguous integer codes, scales and zero points."""
    N, K = qweight.shape[0], qweight.shape[1] * 8 // bits
    G = K if group_size == -1 else group_size

    def build():
        scales = _zero_groups_unscaled(qweight, scale, zero, bits, G)
        weight = Weight(qweight.data_ptr(), scales.data_ptr(), None if zero is None else zero.data_ptr(), N, K,
                        qweight.stride(0), G, bits)
        weight.scales = scales  # kept alive while the Weight is: it may be a copy
        return weight

    return _prepared(_PREPARED["int"], qweight, (qweight, scale, zero), build)


def _zero_groups_unscaled(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                          G: int) -> torch.Tensor:
    """``scale``, or a copy with 0 for each group of zero weights (``prepared.zero_groups``): the kernels compute
    ``s * (sum q x - z * sum x)``, whose residue there a large scale makes far larger than the other outputs."""
    empty = zero_groups(qweight, zero, bits, G)
    return scale.masked_fill(empty, 0) if bool(empty.any()) else scale


def dequantize_supported(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """2-, 3-, 4- or 8-bit codes on CPU whose groups (or rows) are a multiple of 8 long (16 for 4 bits), to fp32,
    bf16 or fp16; eagerly, and with no gradient wanted through the scales (C has no autograd)."""
    group = weight.shape[1] if weight.group_size == -1 else weight.group_size
    return (
        weight.bits in (2, 3, 4, 8) and group % (16 if weight.bits == 4 else 8) == 0 and dtype in _DTYPE_CODES
        and weight.qweight.is_cpu and _dequantize_allowed(weight.scale)
    )


def _dequantize_allowed(scale: torch.Tensor) -> bool:
    """What both dequantize loops need beyond their layouts: no gradient wanted through the scales, an eager
    call, not inside :func:`pytorch_dequantize`, and the kernels built."""
    return (
        not (torch.is_grad_enabled() and scale.requires_grad) and not torch.compiler.is_compiling()
        and not SWITCHES.no_dequantize and available()
    )


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_codes(codes, scale, zero, G).to(dtype)`` (``qinfer.format``) in C, the same bits, for
    weights :func:`dequantize_supported` accepts: ``[N, K]`` in stored column order."""
    w = weight
    tensors = tuple(None if t is None else t.contiguous() for t in (w.qweight, w.scale, w.zero))
    out = torch.empty(w.shape, dtype=dtype)
    lib = _library()[0]
    kernel = lib.qinfer_int4_dequantize if w.bits == 4 else lib.qinfer_int_dequantize
    kernel(ctypes.byref(_int_weight(*tensors, w.bits, w.group_size)), out.data_ptr(), _DTYPE_CODES[dtype])
    return out


def _fp8_op(x, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    return _run(_library()[0].qinfer_fp8_gemv, x, _fp8_weight(codes, scale.contiguous()), bias)


def _fp8_weight(codes: torch.Tensor, scale: torch.Tensor) -> Weight:
    """The prepared Weight of E4M3 codes (rows contiguous) and a contiguous scale."""

    def build():
        return Weight(codes.data_ptr(), scale.data_ptr(), None, *codes.shape, codes.stride(0), scale.numel())

    return _prepared(_PREPARED["fp8"], codes, (codes, scale), build)


def fp8_dequantize_supported(weight: Fp8Weight, dtype: torch.dtype) -> bool:
    """E4M3 codes on CPU, rows contiguous and a multiple of 8 long, to fp32, bf16 or fp16; eagerly, and with no
    gradient wanted through the scale."""
    codes = weight.weight
    return (
        weight.shape[1] % 8 == 0 and codes.stride(1) == 1 and codes.is_cpu and dtype in _DTYPE_CODES
        and _dequantize_allowed(weight.scale)
    )


def fp8_dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """``Fp8Weight.dequantize(dtype)`` (``qinfer.format.e4m3_times`` and a cast) in C, the same bits, for
    weights :func:`fp8_dequantize_supported` accepts: ``[N, K]``."""
    out = torch.empty(weight.shape, dtype=dtype)
    _library()[0].qinfer_fp8_dequantize(ctypes.byref(_fp8_weight(weight.weight, weight.scale.contiguous())),
                                        out.data_ptr(), _DTYPE_CODES[dtype])
    return out


def _prepared(store: dict, key: torch.Tensor, tensors: tuple, build) -> Weight:
    """``build()`` once per ``key`` tensor (dropped when it is freed), built again whenever ``tensors``' data or
    the key's layout has moved: a Parameter whose ``.data`` was replaced keeps its id. The store holds no tensor,
    and a Weight is used only with the pointers and layout it was built from."""
    where = (key.shape, key.stride(), *(0 if t is None else t.data_ptr() for t in tensors))
    entry = per_weight(store, key, lambda _: (where, build()))
    if entry[0] != where:
        entry = store[id(key)] = (where, build())
    return entry[1]


def _run(kernel, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], weight.N, dtype=x.dtype)
    b = None if bias is None else bias.to(x.dtype).contiguous()  # added in fp32 before y's one rounding
    if kernel(ctypes.byref(weight), x.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
              _DTYPE_CODES[x.dtype]):
        raise MemoryError("out of memory for a decode row's fp32 copy")
    return y


# the operators torch.compile sees (registered through torch.library.Library, whose dispatch costs ~7 us a
# call here against ~25 us through torch.library.custom_op; see fp8_cpu)
_LIBRARY = torch.library.Library("qinfer", "FRAGMENT")
_LIBRARY.define("bf16_gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_LIBRARY.define("int_gemv(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, int bits, int group_size,"
                " Tensor? bias=None) -> Tensor")
_LIBRARY.define("fp8_gemv(Tensor x, Tensor codes, Tensor scale, Tensor? bias=None) -> Tensor")
_LIBRARY.impl("bf16_gemv", _bf16_op, "CPU")
_LIBRARY.impl("int_gemv", _int_op, "CPU")
_LIBRARY.impl("fp8_gemv", _fp8_op, "CPU")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps, float offset, bool scale_in_fp32) -> Tensor")
_LIBRARY.impl("rms_norm", _rms_norm_op, "CPU")
_LIBRARY.define("decode_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? k_scale=None, "
                "Tensor? v_scale=None, Tensor? k_pos=None, Tensor? v_pos=None) -> Tensor")
_LIBRARY.impl("decode_attention", _attention_op, "CPU")


@torch.library.register_fake("qinfer::bf16_gemv")
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("qinfer::int_gemv")
def _(x, qweight, scale, zero, bits, group_size, bias=None):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@torch.library.register_fake("qinfer::fp8_gemv")
def _(x, codes, scale, bias=None):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


@torch.library.register_fake("qinfer::rms_norm")
def _(x, weight, eps, offset, scale_in_fp32):
    return torch.empty_like(x)


@torch.library.register_fake("qinfer::decode_attention")
def _(q, k, v, scale, k_scale=None, v_scale=None, k_pos=None, v_pos=None):
    return q.new_empty(q.shape)
