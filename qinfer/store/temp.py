"""Temp files and folders named ``<prefix><pid>-<random>`` beside their final place, locked while in use, and
swept once the process that made them is gone (a SIGKILL, a power cut)."""

import glob
import os
import shutil
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: the pid alone tells whether a temp folder is in use
    fcntl = None


def temp_path(parent: Path, prefix: str, folder: bool) -> Path:
    """A new temp folder (or empty file) in ``parent`` named ``<prefix><pid>-<random>``, after
    :func:`sweep_temp` of the same prefix. This process holds a lock on it (:func:`release` lets go) that tells
    a sweep elsewhere it is in use, where the pid cannot: another container or machine sharing the folder."""
    sweep_temp(parent, prefix)
    name = f"{prefix}{os.getpid()}-"
    if folder:
        path = Path(tempfile.mkdtemp(prefix=name, dir=parent))
    else:
        fd, made = tempfile.mkstemp(prefix=name, dir=parent)
        os.close(fd)
        path = Path(made)
    _hold(path)
    return path


_held: dict[str, int] = {}  # temp path -> the descriptor holding its lock


def _lock(path: Path) -> int | None:
    """A descriptor holding ``path``'s lock, or None where it cannot be opened or the file system has no locks;
    BlockingIOError where another descriptor holds it."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:  # a file system without locks: the pid alone tells
        os.close(fd)
        return None
    return fd


def _hold(path: Path) -> None:
    fd = _lock(path)  # (just made: no one else holds it)
    if fd is not None:
        _held[str(path)] = fd


def release(path: Path) -> None:
    """Let go of the lock :func:`temp_path` took on ``path`` (renamed into place, or removed)."""
    fd = _held.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def _locked(path: Path) -> bool:
    """Whether a process, here or in another container or machine sharing the folder, holds ``path``'s lock."""
    if str(path) in _held:
        return True
    try:
        fd = _lock(path)
    except BlockingIOError:
        return True
    if fd is not None:
        os.close(fd)
    return False


def sweep_temp(parent: Path, prefix: str) -> None:
    """Remove the :func:`temp_path` leftovers in ``parent`` with ``prefix`` whose process is gone (killed with
    SIGKILL, a power cut) and which no process holds, so they never pile up."""
    for stale in Path(parent).glob(f"{glob.escape(prefix)}*"):
        if abandoned(stale, prefix):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def abandoned(path: Path, prefix: str) -> bool:
    """Whether the temp path ``<prefix><pid>-...`` was left by a process that is gone and that no one holds."""
    pid = path.name[len(prefix):].split("-", 1)[0]
    return pid.isdigit() and not _alive(int(pid)) and not _locked(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
