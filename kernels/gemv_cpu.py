"""A few activation rows times a bf16, integer (2, 3, 4, 8 bits) or FP8 weight on an x86-64 CPU: a decode step's
GEMV (or a batch of decode steps'), in C (``gemv_cpu.c``, built and loaded by ``cpu_library``); and a prompt's packed
weights dequantized in C.

Decode at batch 1 reads every weight once per token, so its linears should stream at the memory bandwidth.
PyTorch's own one-row kernels do not on a CPU with AVX2 only: ATen's bf16 GEMV widens and sums well below the
bandwidth the roofline measures (gemma3-270m's bf16 lm_head is most of a step's bytes); its int4 weight-only kernel
(``int4_cpu``) reads a 2048 x 640 weight of 0.7 MB far slower than that; 2-, 3- and 8-bit codes went through one
int8 matmul per group (``int8_cpu``) and FP8 codes through an fp16 copy of the weight (``fp8_cpu``) (figures in
docs/results.md, "Speed against the roofline" and "Figures formerly in code comments").
``gemv_cpu.c`` does each product in one pass over the stored bytes with AVX2/FMA/F16C: bf16 bits move into fp32 in
registers; 4-bit codes are unpacked in registers, their nibbles meeting the row's even and odd entries (on a CPU
with AVX-VNNI or AVX512-VNNI, groups of 64 or more, bf16 or fp16 rows: as bytes in integer dot products,
VPDPBUSD, against x in 15-bit fixed point per group, exact integer sums scaled once a group, within max|x in the
group| / 32766 of each x where bf16 keeps 2^-9 of x itself; an fp32 row keeps the float loop; which loop is
chosen in ``cpu_library``); 2- and 3-bit codes, 8 to a 16- or 24-bit word, by a shift per lane; integer codes are
summed against x per group and scaled once (``s * (sum q x - z * sum x)``; a group whose codes all equal its zero
point is given scale 0, so it gives exactly 0 where the two sums would leave a residue times its scale); E4M3
codes move into fp16 bits (sign-extended, shifted, masked: exact, subnormals too) and F16C widens them. Rows
split across OpenMP threads (PyTorch's own runtime: ``torch.set_num_threads``).
Every product and sum is fp32 (the VNNI loop's are exact integers until each group's is scaled) and each output is
rounded once to the row's dtype, a bias (Qwen2's q/k/v) added in fp32 before that, as PyTorch's ``linear`` adds
it: the references' results up to the order of their sums (and the VNNI loop's fixed-point x), except where the
zero term cancels most of ``sum q x`` (x far from zero mean over a long group: fp32 rows then differ from the
reference by up to ~1e-4 of the output where the reference's own error is ~1e-7).
``python -m qinfer.evals.diagnostics.gemv_bench MODEL`` times each against PyTorch's path side by side.

Several rows (a serving engine's batch of decode steps, M = ``x.numel() // K``) go through the same kernels in one
call: each weight row is read once for all M rows, widened (or unpacked to bytes for the VNNI loop) a tile at a time
and summed against every row from L1; each row is prepared (fp32 copy, group sums, its own fixed point) once per
call. A row's output is bit for bit what it gives alone (the same products summed in the same order, the same
fixed point, the same rounding and bias), whichever rows share the call: a sequence's outputs do not depend on its
batch, and one row is just M = 1. ``ROWS_MAX`` bounds M per format where the kernels are not slower than the path
the callers took before for M rows (oneDNN's bf16 matmul; PyTorch's int4 kernel, ``int4_cpu``; a dense matmul after
the C dequantize), as ``gemv_bench --rows`` measured it on gemma3-270m's linears (docs/RESULTS-LOG.md, 2026-12-07):
bf16 rows up to 64 where the AMX-BF16 or AVX512-BF16 loop applies (below; else 4), FP8 up to 4 (from 8 the matmuls are
faster); 4-bit codes up to 64 where the AVX512-VNNI loop
over tiles applies (below), else 1 (the one-row loops sum each row's groups apart, and ``int4_cpu``'s AVX-512
kernel is faster from 2 rows); 8-bit codes as many as 4-bit ones where their loop over tiles applies; 2-, 3- and
8-bit codes up to 4 elsewhere (before, a dense matmul after dequantizing the whole weight each call). Past
``ROWS_MAX`` a batch's rows take those paths, whose sums depend on the batch.

4-bit codes on a CPU with AVX512-VNNI (bf16 or fp16 rows, groups of 64 or more) take a loop of their own for any M,
one row included: each weight's codes are repacked once (``int4_tiles``: 16 output rows x 8 columns per 64-byte
vector, kept beside the prepared Weight), a vector's nibbles unpacked once for up to 8 rows of x, whose fixed-point
bytes (the same 15-bit x per group as the one-row VNNI loop) are broadcast into VPDPBUSD; exact int32 sums per row
and output over a group, then one vector ``s * (t * step - z * sum x)`` per group into fp32 sums, no horizontal
ones. Its cost grows little per row, and each output's arithmetic does not depend on the rows beside it. 8-bit
codes (an ``--quantize-lm-head`` lm_head) take the same loop where their groups are 16 to 512 long (longer ones could
overflow its int32 sums): 16 output rows x 4 columns of codes per vector, used as bytes as they are. On a CPU with
AMX-INT8 (and the OS's leave to use its tiles) 8-bit codes take AMX instead from 5 rows of x on: TDPBSUD multiplies x's
fixed-point bytes (16 rows a tile, zero rows past M, repacked per call per group) by 64 columns of the same repacked
tiles, whose 64-byte vectors are already the B operand's rows; each group's exact int32 sums then become fp32 by the
VNNI loop's own operations, so the outputs are that loop's bit for bit, and fewer rows keep the VNNI loop (there the
faster) without a row's bits depending on its batch. ``cpu_library.int8_without_amx`` takes the VNNI loop at every
M (a side-by-side timing: ``gemv_bench --int8-loops``).

bf16 rows against a bf16 weight on a CPU with AVX512-BF16 take a loop of their own for any M, one row included, on
the weight's own layout (gemma3's lm_head is also its embedding table: no repacked copy): VDPBF16PS multiplies 32
pairs of bf16 a vector (exact in fp32) and adds each lane's two products to its fp32 sum, rounding once per lane and
reading and writing denormals as zero. Blocks of 8 output rows meet up to 3 rows of x a pass, one accumulator per
(row, output), each summed over the columns in one fixed order, the last part of 32 masked (any K); a pass's 8
accumulators per row become one vector of sums by the same tree in every lane. On a CPU with AMX-BF16 (and the
OS's leave to use its tiles) bf16 rows take AMX instead, again for any M and on the weight's own layout: the
transpose y^T = W x^T, TDPBF16PS multiplying a tile of 16 weight rows x 32 columns, loaded with the rows' stride,
by x repacked once per call into 16-row blocks of column pairs (rows of x past M are zeros: one row costs the
tiles nothing that matters against reading the weight, whose bytes bound the time, where the VDPBF16PS loop's
cost grows with the rows). Each output is zeroed and summed over the columns in order, 32 a tile, from its own
weight row and row of x alone, so a row's outputs are again its bits alone; TDPBF16PS reads bf16 denormals as
zero too, but sums in another order than VDPBF16PS. ``cpu_library.bf16_without_amx`` takes the AVX512-BF16 loop
instead, ``cpu_library.bf16_without_dot`` the fp32 loop (widened weight tiles, fp32 FMAs), as fp32 and fp16 rows
always do; the loops' outputs differ in their sums' order and roundings, each within one bf16 rounding and the fp32
sum's error.

A prompt's GEMM needs its packed weights dense: ``dequantize`` and ``fp8_dequantize`` write an integer or FP8
weight out in the activations' dtype, the format's own numbers bit for bit, in one pass, several times as fast as
its PyTorch ops (``python -m qinfer.evals.diagnostics.prefill_bench MODEL``; figures in docs/results.md, "The main
job"). Inside ``cpu_library.pytorch_dequantize`` the callers take the format's PyTorch ops instead.

Each entry point has a ``*_supported`` test the callers (``qinfer.kernels.dense``, ``quant_linear``) ask first; it
is False where the library is not built (``cpu_library.available()``), and the callers keep PyTorch's kernels.
Under ``torch.compile``, and under the profiler (so ``decode_profile`` names them), the GEMVs are called as the
operators ``torch.ops.qinfer.bf16_gemv``, ``int_gemv`` and ``fp8_gemv``, opaque to inductor; other eager calls
skip their dispatch. A weight's pointers and layout are read once (``Weight``, kept per weight tensor in
``_PREPARED``) and read again only when its data moves.
"""

import contextlib
import ctypes

import torch
from torch.autograd import profiler

from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.kernels import cpu_library
from qinfer.kernels.cpu_library import DTYPE_CODES, OPS
from qinfer.kernels.int4_tiles import tile_int4, tile_int8
from qinfer.kernels.prepared import per_weight, zero_groups

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_PREPARED: dict[str, dict] = {"bf16": {}, "int": {}, "fp8": {}}  # per_weight stores: (data pointers, Weight)
# The most rows of x a call takes, per format (4-bit codes apart from 2, 3 and 8 bits): measured, see the docstring.
# 4-bit codes take that many only through the loop over tiles (_tiled), and 8-bit codes take as many there; elsewhere
# 4-bit codes take one row, 2-, 3- and 8-bit ones ROWS_MAX["int"]. bf16 rows take that many
# only through a dot-product loop (cpu_library.bf16_dot); through the fp32 loop at most BF16_FP32_LOOP_ROWS.
ROWS_MAX = {"bf16": 64, "int4": 64, "int": 4, "fp8": 4}
BF16_FP32_LOOP_ROWS = 4


def _rows(x: torch.Tensor, K: int, kind: str, most: int | None = None) -> bool:
    """x is [..., K] on CPU, of a dtype the kernels take, with 1 to ``ROWS_MAX[kind]`` (or ``most``) rows."""
    most = ROWS_MAX[kind] if most is None else most
    return x.is_cpu and x.dim() > 0 and x.shape[-1] == K > 0 and 1 <= x.numel() // K <= most \
        and x.dtype in DTYPE_CODES


def _tiled(x_dtype: torch.dtype, group: int, bits: int = 4) -> bool:
    """Whether rows of ``x_dtype`` against ``bits``-bit codes in groups of ``group`` take the AVX512-VNNI loop over
    tiles of 16 output rows (bf16 or fp16 rows; 4-bit groups of 64 or more, 8-bit groups of 16 to 512, where its
    int32 sums cannot overflow; the CPU and the switches on that loop): the loop whose cost grows little per row.
    Elsewhere the integer loops sum each row's groups apart (4 bits: one row a call)."""
    fits = group % 64 == 0 and group <= 65536 if bits == 4 else bits == 8 and group % 16 == 0 and group <= 512
    return x_dtype != torch.float32 and fits and cpu_library.int4_vnni() == "AVX512-VNNI"


def bf16_rows_max() -> int:
    """The most bf16 rows a bf16 GEMV call takes here: ``ROWS_MAX["bf16"]`` through a dot-product loop (AMX-BF16 or
    AVX512-BF16), else at most ``BF16_FP32_LOOP_ROWS`` (the fp32 loop's cost grows by about a one-row call per
    row)."""
    most = ROWS_MAX["bf16"]
    return most if cpu_library.bf16_dot() else min(most, BF16_FP32_LOOP_ROWS)


def bf16_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Up to :func:`bf16_rows_max` bf16 rows against a bf16 weight [N, K] (any K) whose rows are contiguous, with no
    gradient wanted through either (C has none: a dequantized weight being tuned takes PyTorch's product)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (
        weight.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16 and weight.is_cpu and weight.stride(1) == 1
        and not grad and cpu_library.available() and _rows(x, weight.shape[1], "bf16", bf16_rows_max())
    )


def int_supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Up to ``ROWS_MAX["int4"]`` rows (other widths: ``ROWS_MAX["int"]``) against 2-, 3-, 4- or 8-bit codes whose
    groups (or rows, per channel) are a multiple of 16 long."""
    group = weight.shape[1] if weight.group_size == -1 else weight.group_size
    # a gradient wanted through the scales (C has none): one row, as before the tiles, batches the PyTorch paths
    grad = torch.is_grad_enabled() and weight.scale.requires_grad
    tiled = _tiled(x.dtype, group, weight.bits) and not grad
    most = ROWS_MAX["int4"] if tiled else 1 if weight.bits == 4 else None
    return (
        _rows(x, weight.shape[1], "int4" if weight.bits == 4 or tiled else "int", most) and weight.bits in (2, 3, 4, 8)
        and group % 16 == 0 and weight.qweight.is_cpu and cpu_library.available()
    )


@contextlib.contextmanager
def one_row_only():
    """Inside it, the kernels take one row at a time (``ROWS_MAX`` 1 for every format): several rows take the paths
    they took before the kernels took rows (a side-by-side timing: ``gemv_bench --rows``)."""
    prior = dict(ROWS_MAX)
    ROWS_MAX.update(dict.fromkeys(ROWS_MAX, 1))
    try:
        yield
    finally:
        ROWS_MAX.update(prior)


class Weight(ctypes.Structure):
    """A weight as the C kernels read it (``qinfer_weight`` in gemv_cpu.c): pointers into tensors kept alive
    elsewhere (by the model), built once per weight (:func:`_prepared`)."""

    _fields_ = [("w", _P), ("scale", _P), ("zero", _P), ("N", _I64), ("K", _I64), ("ld", _I64), ("group", _I64),
                ("bits", _I64), ("tiles", _P), ("tile_sz", _P)]


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row ``x`` [..., K] and a bf16 ``weight`` [N, K]: [..., N] in x's dtype."""
    if torch.compiler.is_compiling() or profiler._is_profiler_enabled:
        return torch.ops.qinfer.bf16_gemv(x, weight, bias)
    return _bf16_op(x, weight, bias)


def fp8_supported(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Up to ``ROWS_MAX["fp8"]`` rows against E4M3 codes [N, K], K a multiple of 8, rows contiguous."""
    codes = weight.weight
    return (
        _rows(x, weight.shape[1], "fp8") and weight.shape[1] % 8 == 0 and codes.is_cpu
        and codes.stride(1) == 1 and cpu_library.available()
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
    return _run(cpu_library.library()[0].qinfer_bf16_gemv, x, _bf16_weight(weight), bias)


def _bf16_weight(weight: torch.Tensor) -> Weight:
    def build():
        return Weight(weight.data_ptr(), None, None, *weight.shape, weight.stride(0), 0)

    return _prepared(_PREPARED["bf16"], weight, (weight,), build)


def prepared(weight, x: torch.Tensor) -> tuple[str, Weight] | None:
    """(kind, Weight): what ``linear(x, weight)`` hands the C GEMV, where it takes ``x``'s rows against ``weight``
    (kind "bf16", "int" or "fp8": which of them), else None. For a caller that makes the same calls from C
    (``decode_cpu``); the Weight points into ``weight``'s tensors, and holds what it built itself."""
    if isinstance(weight, torch.Tensor):
        return ("bf16", _bf16_weight(weight)) if bf16_supported(x, weight) else None
    if isinstance(weight, QuantizedWeight):
        w = weight
        if not int_supported(x, w) or w.perm is not None or not all(
                t is None or t.is_contiguous() for t in (w.qweight, w.scale, w.zero)):
            return None
        return "int", _int_weight(w.qweight, w.scale, w.zero, w.bits, w.group_size)
    if isinstance(weight, Fp8Weight) and fp8_supported(x, weight) and weight.scale.is_contiguous():
        return "fp8", _fp8_weight(weight.weight, weight.scale)
    return None


def _int_op(x, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int,
            bias: torch.Tensor | None = None):
    if not (qweight.is_contiguous() and scale.is_contiguous() and (zero is None or zero.is_contiguous())):
        qweight, scale, zero = (None if t is None else t.contiguous() for t in (qweight, scale, zero))
        # contiguous copies, prepared for this call only
        return _int_op(x, qweight, scale, zero, bits, group_size, bias)
    lib = cpu_library.library()[0]
    return _run(lib.qinfer_int_gemv, x, _int_weight(qweight, scale, zero, bits, group_size), bias)


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
        if bits in (4, 8) and _tiled(torch.bfloat16, G, bits):  # the loop over tiles' layout (int4_tiles), on its CPUs
            weight.tiled = (tile_int4 if bits == 4 else tile_int8)(qweight, scales, zero, G)  # kept alive, as scales
            weight.tiles, weight.tile_sz = (t.data_ptr() for t in weight.tiled)
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
        weight.bits in (2, 3, 4, 8) and group % (16 if weight.bits == 4 else 8) == 0 and dtype in DTYPE_CODES
        and weight.qweight.is_cpu and _dequantize_allowed(weight.scale)
    )


def _dequantize_allowed(scale: torch.Tensor) -> bool:
    """What both dequantize loops need beyond their layouts: no gradient wanted through the scales, an eager
    call, not inside ``cpu_library.pytorch_dequantize``, and the kernels built."""
    return (
        not (torch.is_grad_enabled() and scale.requires_grad) and not torch.compiler.is_compiling()
        and not cpu_library.SWITCHES.no_dequantize and cpu_library.available()
    )


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_codes(codes, scale, zero, G).to(dtype)`` (``qinfer.format``) in C, the same bits, for
    weights :func:`dequantize_supported` accepts: ``[N, K]`` in stored column order."""
    w = weight
    tensors = tuple(None if t is None else t.contiguous() for t in (w.qweight, w.scale, w.zero))
    out = torch.empty(w.shape, dtype=dtype)
    lib = cpu_library.library()[0]
    kernel = lib.qinfer_int4_dequantize if w.bits == 4 else lib.qinfer_int_dequantize
    kernel(ctypes.byref(_int_weight(*tensors, w.bits, w.group_size)), out.data_ptr(), DTYPE_CODES[dtype])
    return out


def _fp8_op(x, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    return _run(cpu_library.library()[0].qinfer_fp8_gemv, x, _fp8_weight(codes, scale.contiguous()), bias)


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
        weight.shape[1] % 8 == 0 and codes.stride(1) == 1 and codes.is_cpu and dtype in DTYPE_CODES
        and _dequantize_allowed(weight.scale)
    )


def fp8_dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """``Fp8Weight.dequantize(dtype)`` (``qinfer.format.e4m3_times`` and a cast) in C, the same bits, for
    weights :func:`fp8_dequantize_supported` accepts: ``[N, K]``."""
    out = torch.empty(weight.shape, dtype=dtype)
    prepared = _fp8_weight(weight.weight, weight.scale.contiguous())
    cpu_library.library()[0].qinfer_fp8_dequantize(ctypes.byref(prepared), out.data_ptr(), DTYPE_CODES[dtype])
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
              x.numel() // weight.K, DTYPE_CODES[x.dtype]):
        raise MemoryError("out of memory for the rows' fp32 copies")
    return y


# the operators torch.compile sees (on cpu_library's fragment of the qinfer namespace)
OPS.define("bf16_gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
OPS.define("int_gemv(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, int bits, int group_size,"
           " Tensor? bias=None) -> Tensor")
OPS.define("fp8_gemv(Tensor x, Tensor codes, Tensor scale, Tensor? bias=None) -> Tensor")
OPS.impl("bf16_gemv", _bf16_op, "CPU")
OPS.impl("int_gemv", _int_op, "CPU")
OPS.impl("fp8_gemv", _fp8_op, "CPU")


@torch.library.register_fake("qinfer::bf16_gemv")
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("qinfer::int_gemv")
def _(x, qweight, scale, zero, bits, group_size, bias=None):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@torch.library.register_fake("qinfer::fp8_gemv")
def _(x, codes, scale, bias=None):
    return x.new_empty(*x.shape[:-1], codes.shape[0])

