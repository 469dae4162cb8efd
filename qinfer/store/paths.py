"""Where pulled models, conversions and data live: ``$QINFER_CACHE`` or ``~/.cache/qinfer``."""

import os
from pathlib import Path

from qinfer.errors import QinferError


# The cache folders qinfer alone writes (pulled built-ins, GGUF and foreign-format conversions): never an -o.
CACHE_OWNED = ("models", "converted", "gguf")


def cache_root() -> Path:
    """The cache folder's path (not made)."""
    if os.environ.get("QINFER_CACHE"):
        return Path(os.environ["QINFER_CACHE"]).expanduser()
    try:
        return Path.home() / ".cache" / "qinfer"
    except RuntimeError:  # no HOME and no passwd entry (cron, a container's arbitrary user id)
        raise QinferError("there is no home folder to keep qinfer's cache in: set QINFER_CACHE to a folder you can "
                          "write to") from None


def cache_dir(*parts: str) -> Path:
    """The cache folder, or its subfolder ``parts`` (``cache_dir("models")``), made if absent: one line where a
    file stands in the way, before any work whose result would go there."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # the path itself is a file (a file on the way to it: qinfer.cli.command's unwritable path)
        where = "QINFER_CACHE" if os.environ.get("QINFER_CACHE") else "the cache folder"
        raise QinferError(f"cannot write {where} {root}: it is a file, not a folder; set QINFER_CACHE to a folder "
                          "you can write to") from None
    path = root.joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise QinferError(f"cannot write the cache folder {path}: a file stands in its way; move the file, or set "
                          "QINFER_CACHE to another folder") from None
    return path
