"""This machine's roofline, measured: memory read bandwidth and matmul peaks, cached as JSON.

Decode reads every weight once per token and does ~2 FLOP per weight, so it sits on the bandwidth
slope; prefill multiplies the weights by many tokens at once and meets the compute ceiling. What bounds
decode is *read* bandwidth, so we stream a buffer far larger than the last-level cache (1 GiB, 32x even
a 32 MiB L3) through ``.sum()``, a read-only reduction. A copy would also write, and its write-allocate
traffic would make the figure neither a read nor a read+write bandwidth. The fp32 sum is vectorised and
multi-threaded in torch, so memory limits it, not arithmetic (an int32 sum is not: it widens to int64).
On a CPU the buffer lies in 2 MiB pages where the OS has transparent huge pages, as the weights the qinfer
commands run do (``qinfer.model.loader.into_huge_pages``): in 4 KiB pages every 4 KiB read pays an address
translation, and the same sum reads less (docs/results.md, "Speed against the roofline").

Compute peaks are large square matmuls per dtype (``2 N^3`` FLOP) with torch's default thread count, in
the layout every linear layer runs: ``x @ w.T`` with ``w`` stored (out, in). On a CPU without AVX-512,
torch's bf16 ``a @ b`` takes a far slower path than ``a @ b.T``, and a peak timed on it gave MFUs far above
100% (docs/results.md, "Figures formerly in code comments"). ``N`` is the first power of two from 256
whose matmul takes at least 50 ms, so the ceiling is measured on a size where blocking overheads are
amortised, not on a size that runs for minutes. Each figure is the median of several repetitions after a
warm-up run. GB/s are 1e9 bytes per second; TFLOP/s 1e12 FLOP/s.
Where other processes kept more than ``BUSY_CPUS`` CPUs busy meanwhile (``/proc/stat`` less this process's own
CPU time), the figures are used once, with a note, and not cached.

``device="cuda"`` runs the same measurements with ``torch.cuda.synchronize`` around each; the tests
exercise the CPU path only.

Cache: ``qinfer.store.paths.cache_dir() / "roofline-<device>.json"``, reused while the machine, torch version and
thread count match the current process (any of them changes the roofline) and it timed ``MATMUL_OP``,
re-measured with ``force=True``. The machine is more than the CPU's name, which virtual machines often
shorten ("AMD EPYC" for an AVX-512 part and an AVX2 one alike): its family, model and stepping, CPU count
and vector extensions (a GPU's compute capability, memory and SM count), so a cache folder carried to other
hardware is measured again. Two hosts alike in all of these still share a roofline: ``--force`` then. A cache
of another device, or one that cannot be read, is measured again (with a note); a folder in its place is
refused before anything is measured.
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType

import torch

from qinfer.store.atomic import write_atomic
from qinfer.store.paths import cache_dir
from qinfer.errors import QinferError
from qinfer.model.loader import huge_page_buffer, huge_pages_reason

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICES = ("cpu", "cuda")
POINT_KINDS = ("decode", "compiled decode", "prefill")
BUFFER_BYTES = 1 << 30
_MATMUL_TARGET_S = 0.05  # one matmul at least this long: a size that reaches the ceiling
_MATMUL_MAX_N = 16384
_MIN_REPS, _MAX_REPS = 5, 200
# Other processes' average use of the CPUs above which a measurement is not cached: it would read low, and every
# later MBU would read high (a second job on a 2-core machine cut the bandwidth measured: docs/results.md,
# "Speed against the roofline")
BUSY_CPUS = 0.5
PLAUSIBLE_MAX = 1e6  # GB/s and TFLOP/s: a cache past it is damaged, and measured again
MATMUL_OP = "x @ w.T"  # what the peaks time (_matmul); a cache measured another way is re-measured
_LEGACY_MATMUL_OP = "a @ b"  # caches written before the field existed


@dataclass(frozen=True)
class Roofline:
    """Measured ceilings of one device; ``peak_tflops`` and ``matmul_n`` are keyed by dtype name."""

    device: str
    bandwidth_gbs: float  # read bandwidth, 1e9 bytes/s
    peak_tflops: Mapping[str, float]
    threads: int
    cpu_name: str  # the GPU's name when device is "cuda"
    torch_version: str
    timestamp: str  # ISO 8601, UTC
    buffer_bytes: int  # size of the buffer the bandwidth was measured on
    matmul_n: Mapping[str, int]  # side of the square matmul each peak was measured on
    matmul_op: str = MATMUL_OP  # the operation the peaks time
    machine: str = ""  # _machine(device): what the cache must match beyond cpu_name ("" in older caches)
    buffer_pages: str = ""  # _buffer_pages(device): the pages the bandwidth buffer lay in ("" in older caches)

    def __post_init__(self):
        if self.device not in DEVICES:
            raise QinferError(f"Roofline.device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        _positive("Roofline.bandwidth_gbs", self.bandwidth_gbs, PLAUSIBLE_MAX)
        for field in ("peak_tflops", "matmul_n"):
            value = getattr(self, field)
            if not isinstance(value, Mapping) or not value or set(value) - set(DTYPES):
                raise QinferError(f"Roofline.{field} must map some of {', '.join(DTYPES)} to numbers; got {value!r}")
            for dtype, number in value.items():
                _positive(f"Roofline.{field}[{dtype!r}]", number, PLAUSIBLE_MAX if field == "peak_tflops" else None)
            # frozen means frozen: a read-only copy, so no caller can change a cached measurement
            object.__setattr__(self, field, MappingProxyType(dict(value)))
        if set(self.peak_tflops) != set(self.matmul_n):  # each peak was measured on one size
            raise QinferError(f"Roofline.peak_tflops and Roofline.matmul_n must name the same dtypes; got "
                              f"{', '.join(self.peak_tflops)} and {', '.join(self.matmul_n)}")
        for field in ("cpu_name", "torch_version", "timestamp", "matmul_op"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise QinferError(f"Roofline.{field} must be a non-empty str; got {getattr(self, field)!r}")
        if type(self.threads) is not int or self.threads < 1:
            raise QinferError(f"Roofline.threads must be a positive int; got {self.threads!r}")
        if type(self.buffer_bytes) is not int or self.buffer_bytes < 1:
            raise QinferError(f"Roofline.buffer_bytes must be a positive int; got {self.buffer_bytes!r}")

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "bandwidth_gbs": self.bandwidth_gbs,
            "peak_tflops": dict(self.peak_tflops),
            "threads": self.threads,
            "cpu_name": self.cpu_name,
            "torch_version": self.torch_version,
            "timestamp": self.timestamp,
            "buffer_bytes": self.buffer_bytes,
            "matmul_n": dict(self.matmul_n),
            "matmul_op": self.matmul_op,
            "machine": self.machine,
            "buffer_pages": self.buffer_pages,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Roofline":
        return cls(**{"matmul_op": _LEGACY_MATMUL_OP, **data})

    def ridge(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP/byte) where the bandwidth slope meets the ``dtype`` ceiling."""
        return _peak(self, dtype) * 1e12 / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class RooflinePoint:
    """One measured kernel or phase to place under the roof."""

    name: str
    arithmetic_intensity: float  # FLOP/byte
    tflops: float  # achieved
    kind: str  # one of POINT_KINDS

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise QinferError(f"RooflinePoint.name must be a non-empty str; got {self.name!r}")
        _positive("RooflinePoint.arithmetic_intensity", self.arithmetic_intensity)
        _positive("RooflinePoint.tflops", self.tflops)
        if self.kind not in POINT_KINDS:
            raise QinferError(f"RooflinePoint.kind must be one of {', '.join(POINT_KINDS)}; got {self.kind!r}")


def roofline_path(device: str) -> Path:
    return cache_dir() / f"roofline-{device}.json"


def check_roofline_path(device: str) -> None:
    """Refuse a folder where ``device``'s roofline is cached, before anything is measured: it could not be saved."""
    path = roofline_path(device)
    if path.is_dir():
        raise QinferError(f"{path} is a folder, where the {device} roofline is cached: move it, or set QINFER_CACHE "
                          "to another folder")


def measure_roofline(device: str = "cpu", seconds: float = 3.0, force: bool = False) -> Roofline:
    """The roofline of ``device``: from the cache when it still describes this process, else measured.

    ``seconds`` is the rough total budget, shared by the bandwidth and each dtype's peak (each is timed at
    least five times, so a very small budget is exceeded rather than giving a median of one).
    """
    if device not in DEVICES:
        raise QinferError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise QinferError("device 'cuda' requested but torch sees no CUDA GPU; use device='cpu'")
    _positive("seconds", seconds)
    check_roofline_path(device)
    path = roofline_path(device)
    if not force:
        cached = load_roofline(path)
        if cached is not None and cached.device != device:
            print(f"qinfer: ignoring the roofline cache {path} (it describes device {cached.device!r}, not "
                  f"{device!r})", file=sys.stderr)
        elif cached is not None and _describes_this_process(cached):
            return cached
    print(f"qinfer: measuring the {device} roofline (a few seconds)", file=sys.stderr)
    busy, start = busy_cpu_seconds(), time.perf_counter()
    roofline = _measure(device, seconds)
    others = busy_while(busy, start)
    if others is not None:
        print(f"qinfer: other processes kept {others:.1f} CPUs busy while the roofline was measured, so it may read "
              "low; it was not cached: run `qinfer roofline --force` on an idle machine", file=sys.stderr)
        return roofline
    save_roofline(roofline, path)
    return roofline


def busy_cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process has used since boot, this process's own), or None where /proc/stat is not."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def busy_while(before: tuple[float, float] | None, start: float) -> float | None:
    """How many CPUs other processes kept busy since ``before`` (:func:`busy_cpu_seconds`) and ``start``
    (``time.perf_counter()``), when more than ``BUSY_CPUS``: a timing taken meanwhile reads low. Else None."""
    others = others_cpus(before, time.perf_counter() - start)
    return others if others is not None and others > BUSY_CPUS else None


def others_cpus(before: tuple[float, float] | None, wall: float) -> float | None:
    """How many CPUs other processes (or the hypervisor: steal time) kept busy, on average, since ``before``."""
    after = busy_cpu_seconds()
    if before is None or after is None or wall <= 0:
        return None
    # both counts are in clock ticks, rounded at each end (every CPU's and this process's): a short timing
    # would otherwise read as busy from the rounding alone (30 ms on an idle machine: up to 0.67 CPUs)
    slack = (2 * (os.cpu_count() or 1) + 2) / os.sysconf("SC_CLK_TCK")
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1]) - slack) / wall


def load_roofline(path: Path) -> Roofline | None:
    """The roofline saved at ``path``, or None if there is none or it is unreadable (then it is re-measured)."""
    try:
        return Roofline.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except TypeError:  # a field missing, or one Roofline does not have
        print(f"qinfer: ignoring the roofline cache {path} (its fields are not a roofline's)", file=sys.stderr)
        return None
    except (OSError, ValueError, QinferError) as exc:  # JSONDecodeError is a ValueError
        print(f"qinfer: ignoring the unreadable roofline cache {path} ({exc})", file=sys.stderr)
        return None


def save_roofline(roofline: Roofline, path: Path) -> None:
    """Write ``roofline`` as JSON atomically (temp file beside ``path``, then rename)."""
    path = Path(path)
    write_atomic(path, json.dumps(roofline.to_json(), indent=2) + "\n")


def mbu(bytes_per_token: float, seconds_per_token: float, roofline: Roofline) -> float:
    """Model bandwidth utilisation: bytes read per second over the measured read bandwidth."""
    _positive("bytes_per_token", bytes_per_token)
    _positive("seconds_per_token", seconds_per_token)
    return bytes_per_token / seconds_per_token / (roofline.bandwidth_gbs * 1e9)


def mfu(flops: Mapping[str, float], seconds: float, roofline: Roofline) -> float:
    """Model FLOP utilisation of work whose FLOPs multiply in several dtypes (``flops`` maps a dtype name to
    its FLOPs): the time the measured peaks allow for it, each dtype's FLOPs at that dtype's peak, over
    ``seconds``. With one dtype this is FLOP per second over that dtype's peak."""
    if not isinstance(flops, Mapping) or not flops:
        raise QinferError(f"mfu needs FLOPs keyed by dtype name; got {flops!r}")
    _positive("seconds", seconds)
    for dtype, n in flops.items():
        _positive(f"flops[{dtype!r}]", n)
    return sum(n / (_peak(roofline, dtype) * 1e12) for dtype, n in flops.items()) / seconds


def attainable_tflops(arithmetic_intensity: float, roofline: Roofline, dtype: str) -> float:
    """The roof at ``arithmetic_intensity`` FLOP/byte: min(peak, intensity x bandwidth), in TFLOP/s."""
    _positive("arithmetic_intensity", arithmetic_intensity)
    return min(_peak(roofline, dtype), arithmetic_intensity * roofline.bandwidth_gbs * 1e9 / 1e12)


def threads_text(n: int) -> str:
    """"1 thread", "2 threads"."""
    return f"{n} thread{'s' * (n != 1)}"


def format_roofline(roofline: Roofline) -> str:
    """A small table of ``roofline`` for people."""
    head = (
        f"roofline of {roofline.machine or roofline.cpu_name} ({roofline.device}, {threads_text(roofline.threads)}, "
        f"torch {roofline.torch_version}), measured {roofline.timestamp}"
    )
    rows = [f"  {'read bandwidth':<16}{roofline.bandwidth_gbs:10.1f} GB/s      "
            f"(.sum() over {roofline.buffer_bytes / 2**30:g} GiB of fp32{_in_pages(roofline)})"]
    for dtype, peak in roofline.peak_tflops.items():
        n = roofline.matmul_n[dtype]
        rows.append(
            f"  {dtype + ' matmul peak':<16}{peak:10.3f} TFLOP/s   ({roofline.matmul_op}, {n}x{n}; "
            f"ridge at {roofline.ridge(dtype):.1f} FLOP/byte)"
        )
    return "\n".join([head, *rows])


def _measure(device: str, seconds: float) -> Roofline:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    budget = seconds / (1 + len(DTYPES))
    pages = _buffer_pages(device)
    if pages == "2 MiB":
        buffer = huge_page_buffer(BUFFER_BYTES).view(torch.float32).fill_(1.0)  # filled: every page is touched
    else:
        buffer = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32, device=device)
    bandwidth = BUFFER_BYTES / _median_seconds(buffer.sum, sync, budget) / 1e9
    del buffer
    peaks, sizes = {}, {}
    for name, dtype in DTYPES.items():
        n = _matmul_size(dtype, device, sync)
        a = torch.randn(n, n, device=device).to(dtype)
        w = torch.randn(n, n, device=device).to(dtype)
        peaks[name] = 2 * n**3 / _median_seconds(lambda: _matmul(a, w), sync, budget) / 1e12
        sizes[name] = n
    return Roofline(
        device=device,
        bandwidth_gbs=bandwidth,
        peak_tflops=peaks,
        threads=torch.get_num_threads(),
        cpu_name=_device_name(device),
        machine=_machine(device),
        torch_version=torch.__version__,
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        buffer_bytes=BUFFER_BYTES,
        matmul_n=sizes,
        buffer_pages=pages,
    )


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None], budget: float) -> float:
    fn()  # warm-up: first-touch, kernel selection, thread-pool start
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < _MIN_REPS or (len(times) < _MAX_REPS and time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)  # MATMUL_OP: x @ w.T, w stored (out, in) like a linear layer's


def _matmul_size(dtype: torch.dtype, device: str, sync: Callable[[], None]) -> int:
    n = 256
    while n < _MATMUL_MAX_N:
        a = torch.randn(n, n, device=device).to(dtype)
        _matmul(a, a)  # warm-up at this size
        sync()
        start = time.perf_counter()
        _matmul(a, a)
        sync()
        if time.perf_counter() - start >= _MATMUL_TARGET_S:
            break
        n *= 2
    return n


def _cpuinfo() -> list[tuple[str, str]]:
    """``/proc/cpuinfo`` as (key, value) pairs; none off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [tuple(part.strip() for part in line.partition(":")[::2]) for line in text.splitlines()]


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    for key, value in _cpuinfo():
        if key == "model name":
            return value
    return platform.processor() or platform.machine() or "unknown CPU"  # not Linux


_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _machine(device: str) -> str:
    """What tells this machine from another of the same name (see the module docstring)."""
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{p.name}; sm_{p.major}{p.minor}; {p.total_memory >> 20} MiB; {p.multi_processor_count} SMs"
    ids, flags = {}, set()
    for key, value in _cpuinfo():  # off Linux: the name, the CPU count and the architecture
        if key in ("cpu family", "model", "stepping"):
            ids.setdefault(key, value)
        elif key == "flags" and not flags:
            flags = set(value.split())
    isa = ",".join(f for f in _ISA_FLAGS if f in flags) or platform.machine()
    family = " ".join(f"{key} {value}" for key, value in ids.items())
    return f"{_device_name('cpu')}; {family}; {os.cpu_count()} CPUs; {isa}"


def _describes_this_process(roofline: Roofline) -> bool:
    return (
        roofline.threads == torch.get_num_threads()
        and roofline.torch_version == torch.__version__
        and roofline.cpu_name == _device_name(roofline.device)
        and roofline.machine == _machine(roofline.device)
        and set(roofline.peak_tflops) == set(DTYPES)
        and roofline.matmul_op == MATMUL_OP
        and roofline.buffer_pages == _buffer_pages(roofline.device)
    )


def _in_pages(roofline: Roofline) -> str:
    return f" in {roofline.buffer_pages} pages" if roofline.buffer_pages in ("2 MiB", "4 KiB") else ""


def _buffer_pages(device: str) -> str:
    """The pages the bandwidth is read from: a CPU's 2 MiB pages where the OS has transparent huge pages, as
    the qinfer commands hold a model's weights (``qinfer.model.loader.into_huge_pages``), else its 4 KiB ones."""
    if device != "cpu":
        return "device memory"
    return "4 KiB" if huge_pages_reason() else "2 MiB"


def _peak(roofline: Roofline, dtype: str) -> float:
    if dtype not in roofline.peak_tflops:
        raise QinferError(f"no measured peak for dtype {dtype!r}; the roofline has {', '.join(roofline.peak_tflops)}")
    return roofline.peak_tflops[dtype]


def _positive(what: str, value, most: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise QinferError(f"{what} must be a positive finite number; got {value!r}")
    if most is not None and value > most:
        raise QinferError(f"{what} must be at most {most:g} (no machine is that fast); got {value!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qinfer.evals.roofline", description=__doc__.partition("\n")[0])
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument("--seconds", type=float, default=3.0, help="rough measuring budget (default 3)")
    parser.add_argument("--force", action="store_true", help="measure again even if a cached roofline matches")
    args = parser.parse_args(argv)
    try:
        print(format_roofline(measure_roofline(args.device, args.seconds, args.force)))
    except QinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
