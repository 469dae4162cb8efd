"""The eval result cache: one small JSON file per measured part, keyed by everything that determines it.

Layout: ``qinfer.cache.cache_dir() / "eval" / <part> / <key>.json`` where ``part`` is "text", "task" or
"speed" and ``key`` is the sha256 of the JSON of the key fields (the model's content key, the baseline's,
every setting, :data:`CACHE_VERSION`, the torch version). Keying each part on its own settings lets a run
with more tasks, or with ``--speed`` after ``--no-speed``, reuse everything it shares with earlier runs.
Files are written atomically; an unreadable one counts as a miss and is overwritten.
"""

import hashlib
import json
from pathlib import Path

import torch

from qinfer.cache import cache_dir, write_atomic

# Bump when a measurement changes meaning, so old cached numbers are not mixed with new ones.
CACHE_VERSION = 1


def cache_key(part: str, **fields) -> str:
    payload = {"part": part, "cache_version": CACHE_VERSION, "torch": torch.__version__, **fields}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _path(part: str, key: str) -> Path:
    return cache_dir() / "eval" / part / f"{key}.json"


def load(part: str, key: str) -> dict | None:
    try:
        value = json.loads(_path(part, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def store(part: str, key: str, value: dict) -> None:
    path = _path(part, key)
    write_atomic(path, json.dumps(value, indent=1))
