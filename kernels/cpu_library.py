"""The shared library of qinfer's C kernels for an x86-64 CPU (``gemv_cpu.c``): its build, cache and loading, the
switches that send the callers back to PyTorch's kernels for side-by-side timings, and the choice of the 4-bit
GEMV's VNNI loop.

One C file holds every kernel (a decode row's GEMVs and a prompt's dequantize loops: ``gemv_cpu``; a decode
step's RMSNorm rows: ``norm_cpu``; its attention: ``attention_cpu``), and a second, compiled after it as one
translation unit, a decode step's layers made of those kernels (``decode_cpu.c``: ``decode_cpu``), so they are
built and loaded once, as one library, with AVX2/FMA/F16C and OpenMP: the GEMVs' rows and the attention's chunks
of keys split across PyTorch's own threads (``torch.set_num_threads``). Those modules call the library through
:func:`library` and define their operators (``torch.ops.qinfer.*``, opaque to inductor, named in the profiler)
on :data:`OPS`.

The C source is compiled at first use with the system's C compiler into ``<cache>/kernels`` (a one-time cost:
docs/results.md, "Figures formerly in code comments") and loaded with ``ctypes``. The file name carries a hash
of the source, flags and compiler, so a changed one is built anew; the library's sha256 is recorded beside it
and checked before each load, as loading a cut-short library can crash the process. Without a compiler, on a
CPU without AVX2, or with ``QINFER_CPU_GEMV=0`` in the environment, ``available()`` is False
(``unavailable_reason()`` says why) and the callers keep PyTorch's kernels; ``describe()`` says which, in a few
words, for reports and result-cache keys.

4-bit rows have integer dot-product loops (AVX-VNNI, AVX512-VNNI; ``gemv_cpu``) beside the AVX2 float loop:
the C code takes the first this CPU has, and :func:`without_vnni` and :func:`with_vnni` choose another for a
side-by-side timing or a test. bf16 rows against a bf16 weight have two (AMX-BF16, AVX512-BF16) beside the fp32
loop, chosen the same way (:func:`bf16_loop`, :func:`bf16_without_amx`, :func:`with_bf16_loop`,
:func:`bf16_without_dot`); 8-bit codes' loop over tiles has AMX-INT8 beside AVX512-VNNI (:func:`int8_loop`,
:func:`int8_without_amx`, :func:`with_int8_loop`). The kernels take tensors as data pointers and a dtype code
(:data:`DTYPE_CODES`; a quantized KV cache's keys and values also :data:`KV_CODES`), the numbering ``gemv_cpu.c``
uses.
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

from qinfer.store.atomic import write_atomic
from qinfer.store.fingerprint import sha256_file
from qinfer.store.paths import cache_dir
from qinfer.store.temp import temp_path

SOURCE = Path(__file__).with_name("gemv_cpu.c")
# a decode step's layers in one call (decode_cpu): compiled after gemv_cpu.c in one translation unit, as it calls
# that file's kernels
STEP_SOURCE = Path(__file__).with_name("decode_cpu.c")
# read once, with this module: the library is built from (and keyed by) the C this module's calls were written for,
# even if the files change while a process runs (None: unreadable, and the callers keep PyTorch's kernels)
_SOURCE_BYTES = (SOURCE.read_bytes() + b"\n" + STEP_SOURCE.read_bytes()
                 if SOURCE.is_file() and STEP_SOURCE.is_file() else None)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
KV_CODES = {torch.int8: 3, torch.float8_e4m3fn: 4}  # a quantized KV cache's keys and values
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclasses.dataclass
class Switches:
    """Which of the C kernels the callers take, for side-by-side timings; each is set only inside its context
    manager below (``disabled``, ``only_gemvs``, ``pytorch_dequantize``)."""

    disabled: bool = False  # every caller takes PyTorch's kernels
    only_gemvs: bool = False  # RMSNorm and decode attention take PyTorch's ops; the GEMVs stay in C
    no_dequantize: bool = False  # a prompt's packed weights are dequantized by the format's PyTorch ops


SWITCHES = Switches()


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels, or None and why not."""
    if os.environ.get("QINFER_CPU_GEMV", "1") == "0":
        return None, "QINFER_CPU_GEMV=0"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU's vector capability is {torch.backends.cpu.get_cpu_capability()}, not AVX2"
    if _SOURCE_BYTES is None:
        return None, f"{STEP_SOURCE if SOURCE.is_file() and not STEP_SOURCE.is_file() else SOURCE} is missing"
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
    for kernel in (lib.qinfer_bf16_gemv, lib.qinfer_int_gemv, lib.qinfer_fp8_gemv):
        kernel.argtypes, kernel.restype = [_P, _P, _P, _P, _I64, ctypes.c_int], ctypes.c_int
    lib.qinfer_rms_norm.argtypes = [_P, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_float] + [ctypes.c_int] * 3
    lib.qinfer_rms_norm.restype = None
    lib.qinfer_decode_attention.argtypes = ([_P] * 4 + [_I64] * 13 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
                                            + [_P] * 4 + [_I64] * 2)
    lib.qinfer_decode_attention.restype = ctypes.c_int
    lib.qinfer_paged_decode_attention.argtypes = ([_P] * 4 + [_I64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
                                                  + [_P] * 5 + [_I64] * 2 + [_P] * 2)
    lib.qinfer_paged_decode_attention.restype = ctypes.c_int
    for kernel in (lib.qinfer_int4_dequantize, lib.qinfer_int_dequantize, lib.qinfer_fp8_dequantize):
        kernel.argtypes, kernel.restype = [_P, _P, ctypes.c_int], ctypes.c_int
    lib.qinfer_int4_vnni.argtypes, lib.qinfer_int4_vnni.restype = [ctypes.c_int], ctypes.c_int
    lib.qinfer_attention_i8_vnni.argtypes, lib.qinfer_attention_i8_vnni.restype = [ctypes.c_int], ctypes.c_int
    lib.qinfer_bf16_dot.argtypes, lib.qinfer_bf16_dot.restype = [ctypes.c_int], ctypes.c_int
    lib.qinfer_int8_amx.argtypes, lib.qinfer_int8_amx.restype = [ctypes.c_int], ctypes.c_int
    lib.qinfer_decode_layers.argtypes, lib.qinfer_decode_layers.restype = [_P, _P], ctypes.c_int
    lib.qinfer_argmax.argtypes = [_P, _I64, _I64, _I64, ctypes.c_int, _P]
    lib.qinfer_argmax.restype = None
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
    return not SWITCHES.disabled and library()[0] is not None


# A traced graph keeps the path it was traced with: torch.compile takes available() as a constant. This is the mark
# torch.compiler.assume_constant_result sets (tests check it still is), set without importing torch._dynamo, which
# that function does: a large import, in memory and time, for every command that never compiles.
available._dynamo_marked_constant = True


def unavailable_reason() -> str:
    """Why the kernels are not in use ('' when they are)."""
    return library()[1]


def describe() -> str:
    """What a decode step's one-row products run through on CPU, in a few words (``qinfer eval``'s reports): the
    4-bit and bf16 dot-product loops named where they run."""
    if not available():
        return f"PyTorch's one-row kernels ({unavailable_reason()})"
    loops = []
    if int4_vnni():
        loops.append(f"4-bit codes through {int4_vnni()}")
    if int8_loop():
        loops.append(f"8-bit codes through {int8_loop()}")
    if bf16_loop():
        loops.append(f"bf16 rows through {bf16_loop()}")
    return f"qinfer's C GEMVs ({', '.join(loops)})" if loops else "qinfer's C GEMVs"


def row_loop_allowed(*tensors: torch.Tensor) -> bool:
    """What the norm and attention loops need beyond their shapes: no gradient wanted (C has no autograd), an
    eager call (a compiled graph fuses these ops itself), not inside :func:`only_gemvs`, and the kernels built."""
    return (
        not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and not torch.compiler.is_compiling() and not SWITCHES.only_gemvs and available()
    )


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
    return VNNI_LOOPS.get(library()[0].qinfer_int4_vnni(-1), "") if available() else ""


def vnni_loops() -> list[str]:
    """The VNNI loops this CPU can run (AVX512-VNNI first: the one 4-bit rows take where it has both)."""
    return _loops("qinfer_int4_vnni", VNNI_LOOPS)


def _loops(switch: str, loops: dict[int, str]) -> list[str]:
    """The names of ``loops`` (the C switch ``switch``'s codes) this CPU can run, the highest code first."""
    return [name for name in reversed(loops.values()) if _runs(switch, loops, name)]


def _runs(switch: str, loops: dict[int, str], name: str) -> bool:
    with _loop(switch, loops, name) as taken:
        return taken


@contextlib.contextmanager
def _loop(switch: str, loops: dict[int, str], name: str):
    """Inside it, the C switch ``switch`` (``qinfer_int4_vnni``, ``qinfer_bf16_dot``, ``qinfer_attention_i8_vnni``,
    0 off, a code of ``loops`` that loop where the CPU has it, -1 only asks; each returns the setting before) is set
    to ``name``'s code ("": 0); yields whether it took."""
    lib = library()[0] if available() else None
    if lib is None:
        yield False
        return
    code = {v: k for k, v in loops.items()}.get(name, 0)
    prior = getattr(lib, switch)(code)
    try:
        yield getattr(lib, switch)(-1) == code
    finally:
        getattr(lib, switch)(prior)


def _vnni_loop(name: str):
    return _loop("qinfer_int4_vnni", VNNI_LOOPS, name)


def without_vnni():
    """Inside it, 4-bit rows take the AVX2 float loop even where the CPU has VNNI (a side-by-side timing)."""
    return _vnni_loop("")


def with_vnni(name: str):
    """Inside it, 4-bit rows take the VNNI loop ``name`` (one of :func:`vnni_loops`), as a test compares them."""
    if name not in vnni_loops():
        raise ValueError(f"this CPU has no {name} loop (it has: {', '.join(vnni_loops()) or 'none'})")
    return _vnni_loop(name)


ATTENTION_LOOPS = {1: "integer scores", 2: "integer scores and values"}  # qinfer_attention_i8_vnni's codes


def attention_loop() -> str:
    """Which loops attention over int8 KV codes takes (AVX512-VNNI, queries in bf16 or fp16): "integer scores and
    values" (the queries and the softmax weights in 15-bit fixed point against the codes; the default where the CPU
    has AVX512-VNNI), "integer scores" (the values' weighted sums in fp32), or "" (the fp32 loops)."""
    return ATTENTION_LOOPS.get(library()[0].qinfer_attention_i8_vnni(-1), "") if available() else ""


def attention_vnni() -> bool:
    """Whether attention over int8 KV codes takes integer loops (:func:`attention_loop`) rather than the fp32 ones."""
    return attention_loop() != ""


def attention_loops() -> list[str]:
    """The integer attention loops this CPU can run ("integer scores and values" first: the default)."""
    return _loops("qinfer_attention_i8_vnni", ATTENTION_LOOPS)


def attention_without_vnni():
    """Inside it, attention over int8 KV codes takes the fp32 loops even where the CPU has AVX512-VNNI (a
    side-by-side timing, or a test comparing the two)."""
    return _loop("qinfer_attention_i8_vnni", ATTENTION_LOOPS, "")


def with_attention_loop(name: str):
    """Inside it, attention over int8 KV codes takes the loops ``name`` (one of :func:`attention_loops`; "": the
    fp32 ones), as a test or a side-by-side timing compares them."""
    if name and name not in attention_loops():
        raise ValueError(f"this CPU has no {name} loop (it has: {', '.join(attention_loops()) or 'none'})")
    return _loop("qinfer_attention_i8_vnni", ATTENTION_LOOPS, name)


BF16_LOOPS = {1: "AVX512-BF16", 2: "AMX-BF16"}  # qinfer_bf16_dot's numbers of the bf16 dot-product loops


def bf16_loop() -> str:
    """Which dot-product loop bf16 rows against a bf16 weight go through (any number of rows, one included, each
    row's outputs the bits it has alone): "AMX-BF16" (TDPBF16PS on tiles) where the CPU has it, the OS lets the
    process use the tiles and :func:`bf16_without_amx` is off; else "AVX512-BF16" (VDPBF16PS) where the CPU has it;
    "" (the fp32 loop) where neither runs, the compiler knew neither, or inside :func:`bf16_without_dot`."""
    return BF16_LOOPS.get(library()[0].qinfer_bf16_dot(-1), "") if available() else ""


def bf16_dot() -> bool:
    """Whether bf16 rows against a bf16 weight take one of the dot-product loops (:func:`bf16_loop`) rather than
    the fp32 one."""
    return bf16_loop() != ""


bf16_dot._dynamo_marked_constant = True  # as available(): a traced graph keeps the loop's row bound it was traced with


def bf16_loops() -> list[str]:
    """The bf16 dot-product loops this CPU can run (AMX-BF16 first: the one bf16 rows take where it has both)."""
    return _loops("qinfer_bf16_dot", BF16_LOOPS)


def _bf16_loop(name: str):
    return _loop("qinfer_bf16_dot", BF16_LOOPS, name)


def bf16_without_dot():
    """Inside it, bf16 rows take the fp32 loop even where the CPU has a dot-product loop (a side-by-side timing, or
    a test comparing the loops)."""
    return _bf16_loop("")


def bf16_without_amx():
    """Inside it, bf16 rows take the AVX512-BF16 loop even where the CPU has AMX-BF16 (a side-by-side timing);
    where it has no AVX512-BF16 either, the loop they take outside it."""
    return _bf16_loop("AVX512-BF16")


def with_bf16_loop(name: str):
    """Inside it, bf16 rows take the dot-product loop ``name`` (one of :func:`bf16_loops`), as a test compares them."""
    if name not in bf16_loops():
        raise ValueError(f"this CPU has no {name} loop (it has: {', '.join(bf16_loops()) or 'none'})")
    return _bf16_loop(name)


# qinfer_int8_amx's numbers of the AMX loop for 8-bit codes (0: the AVX512-VNNI loop): from a few rows of x on (the
# VNNI loop below: the same bits, and there the faster), or at every M (tests, timings)
INT8_LOOPS = {1: "AMX-INT8", 2: "AMX-INT8 at every M"}


def int8_loop() -> str:
    """Which loop 8-bit codes take where they take the loop over tiles (``gemv_cpu._tiled``): "AMX-INT8" (TDPBSUD on
    tiles; the same outputs bit for bit; from 5 rows of x on, the VNNI loop below) where the CPU has it, the OS lets
    the process use the tiles and :func:`int8_without_amx` is off; "AMX-INT8 at every M" inside
    ``with_int8_loop("AMX-INT8 at every M")``; else "" (the AVX512-VNNI loop)."""
    return INT8_LOOPS.get(library()[0].qinfer_int8_amx(-1), "") if available() else ""


def int8_loops() -> list[str]:
    """The AMX loops for 8-bit codes this CPU can run (["AMX-INT8 at every M", "AMX-INT8"] or [])."""
    return _loops("qinfer_int8_amx", INT8_LOOPS)


def int8_without_amx():
    """Inside it, 8-bit codes take the AVX512-VNNI loop over tiles even where the CPU has AMX-INT8 (a side-by-side
    timing, or a test comparing the two)."""
    return _loop("qinfer_int8_amx", INT8_LOOPS, "")


def with_int8_loop(name: str):
    """Inside it, 8-bit codes take the loop ``name`` (one of :func:`int8_loops`; "": the AVX512-VNNI loop)."""
    if name and name not in int8_loops():
        raise ValueError(f"this CPU has no {name} loop (it has: {', '.join(int8_loops()) or 'none'})")
    return _loop("qinfer_int8_amx", INT8_LOOPS, name)


# The operators torch.compile sees, a fragment of the qinfer namespace: each kernel's module defines its own
# here. Registered through torch.library.Library, whose dispatch costs less a call than torch.library.custom_op's
# (see fp8_cpu; docs/results.md, "Figures formerly in code comments").
OPS = torch.library.Library("qinfer", "FRAGMENT")
