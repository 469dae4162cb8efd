"""The eval result cache: one small JSON file per measured part, keyed by everything that determines it.

Layout: ``qinfer.store.paths.cache_dir() / "eval" / <part> / <key>.json`` where ``part`` is "text", "task" or
"speed" and ``key`` is the sha256 of the JSON of the key fields (the model's content key, the baseline's,
every setting, :data:`CACHE_VERSION`, the torch version, and a fingerprint of the runtime code that produces
the numbers: the decoder, KV cache, loader, format and every kernel, and whether the C kernels are in use, so a
kernel change re-measures; a text or task key also holds the fingerprint of the code that measures that part,
:data:`MEASURE_MODULES`, and a speed key :func:`speed_fingerprint`, so a change to how a part is measured
re-measures it). Keying each part on its own settings lets a run with more tasks, or with ``--speed`` after
``--no-speed``, reuse everything it shares with earlier runs.
Files are written atomically; an unreadable one counts as a miss and is overwritten.
"""

import dataclasses
import functools
import hashlib
import json
import typing
from pathlib import Path

import torch

from qinfer.store.atomic import write_atomic
from qinfer.store.fingerprint import source_fingerprint
from qinfer.store.paths import cache_dir, cache_root
from qinfer.errors import QinferError
from qinfer.kernels import cpu_library
from qinfer.model.loader import weight_pages

T = typing.TypeVar("T")

# Bump when a measurement changes meaning, so old cached numbers are not mixed with new ones.
CACHE_VERSION = 2


# Modules whose code decides what an eval measures (besides the kernels package, which is read whole): the
# decoder and every qinfer module it imports that computes (errors and the cache's paths do not).
RUNTIME_MODULES = ("qinfer.model.arch", "qinfer.model.decoder", "qinfer.model.decode_plan", "qinfer.model.kv_cache",
                   "qinfer.model.loader",
                   "qinfer.format", "qinfer.engine.generate", "qinfer.engine.engine", "qinfer.engine.sampling",
                   "qinfer.engine.scheduler", "qinfer.sources.tokenizer")


@functools.cache
def _runtime_source() -> str:
    return source_fingerprint(RUNTIME_MODULES, "qinfer.kernels")


def code_fingerprint() -> str:
    """sha256 over the source of :data:`RUNTIME_MODULES` and of every module in ``qinfer.kernels``, and which
    kernels a CPU row multiplies through (``QINFER_CPU_GEMV=0``, or no C compiler, gives PyTorch's, whose sums
    round differently)."""
    return hashlib.sha256((_runtime_source() + cpu_library.describe()).encode()).hexdigest()


# Modules whose code decides how the text (perplexity, KL) and the tasks are measured: a text or task key's own part.
MEASURE_MODULES = {
    "text": ("qinfer.evals.accuracy", "qinfer.evals.divergence", "qinfer.evals.perplexity", "qinfer.evals.forward",
             "qinfer.sources.tokenizer"),
    "task": ("qinfer.evals.accuracy", "qinfer.evals.tasks", "qinfer.evals.benchmarks", "qinfer.evals.bigbench",
             "qinfer.evals.forward",
             "qinfer.sources.tokenizer"),
}


@functools.cache
def measure_fingerprint(part: str) -> str:
    """sha256 over the source of ``MEASURE_MODULES[part]`` (the kernels are in :func:`code_fingerprint`); "" for a
    part without its own modules."""
    return source_fingerprint(MEASURE_MODULES[part]) if part in MEASURE_MODULES else ""


# Modules whose code decides how speed is timed and what a step's bytes and FLOPs are: a speed key's own part.
SPEED_MODULES = ("qinfer.evals.speed", "qinfer.evals.costs")


@functools.cache
def speed_fingerprint() -> str:
    """sha256 over the source of :data:`SPEED_MODULES` (and ``qinfer.kernels``, which source_fingerprint reads),
    whether the C GEMV kernels are in use (``QINFER_CPU_GEMV=0`` times PyTorch's) and which pages the weights
    lie in (``QINFER_HUGE_PAGES=0``: the file map's)."""
    code = source_fingerprint(SPEED_MODULES, "qinfer.kernels")
    return hashlib.sha256((code + cpu_library.describe() + weight_pages()).encode()).hexdigest()


def cache_key(part: str, **fields) -> str:
    payload = {
        "part": part, "cache_version": CACHE_VERSION, "torch": torch.__version__, "code": code_fingerprint(),
        "measure": measure_fingerprint(part), **fields,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _path(part: str, key: str) -> Path:
    return cache_dir("eval", part) / f"{key}.json"


def load(part: str, key: str, cls: type[T]) -> T | None:
    """The cached ``cls`` (a dataclass of numbers and strings) under ``key``, or None: a file that is missing,
    unreadable, or not such a record (a field missing, unknown or of the wrong type) counts as a miss."""
    try:
        value = json.loads(_path(part, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict):
        return None
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    missing = dataclasses.MISSING
    required = {f.name for f in fields if f.default is missing and f.default_factory is missing}
    if not required <= set(value) <= {f.name for f in fields}:
        return None
    if not all(_fits(v, hints[name]) for name, v in value.items()):
        return None
    try:
        return cls(**value)
    except (QinferError, TypeError, ValueError):
        return None


def _fits(value, hint) -> bool:
    """Whether a JSON value is of the type ``hint`` (int, float, str, X | None, dict[str, X])."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _fits(v, args[1]) for k, v in value.items())
    if args:  # a union: X | None
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    return isinstance(value, (int, float) if hint is float else hint)


def store(part: str, key: str, value: dict) -> None:
    """Keep ``value`` under ``key``; a cache that cannot be written (read-only, full) is said once, and the
    measurement still reaches the outputs."""
    try:
        write_atomic(_path(part, key), json.dumps(value, indent=1))
    except (OSError, QinferError) as e:
        _not_kept(str(e) if isinstance(e, QinferError) else f"{cache_root() / 'eval'}: {e.strerror or e}")


@functools.lru_cache(maxsize=None)
def _not_kept(why: str) -> None:
    import click

    click.echo(f"note: results not cached: {why}; set QINFER_CACHE to a folder you can write to, to keep them",
               err=True)
