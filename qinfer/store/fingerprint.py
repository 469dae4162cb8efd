"""sha256 of a file, and of the code a cached result came from."""

import hashlib
import importlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def source_fingerprint(modules: tuple[str, ...], *packages: str) -> str:
    """sha256 over the source files of ``modules`` and of every module in each of ``packages`` (by file name and
    bytes): a cached result keyed on it is redone after any change to the code that produced it."""
    files = [Path(importlib.import_module(m).__file__) for m in modules]
    for package in packages:
        folder = Path(next(iter(importlib.import_module(package).__path__)))  # a namespace package has no __file__
        files += sorted(folder.glob("*.py")) + sorted(folder.glob("*.c"))  # C kernels built at first use
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
