"""Where pulled models and data live: ``$QINFER_CACHE`` or ``~/.cache/qinfer``."""

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("QINFER_CACHE") or Path.home() / ".cache" / "qinfer"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def atomic_dir(target: Path, force: bool = False):
    """Yield a temp folder beside ``target``; on success it is renamed to ``target``.

    An exception (including KeyboardInterrupt) removes the temp folder, so an interrupted run never leaves
    a half-written ``target``. With ``force`` an existing ``target`` is replaced only after the new one is
    complete.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the finished folder gets ordinary permissions
    try:
        yield tmp
        if target.exists():
            if not force:
                raise FileExistsError(target)
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to a temp file beside ``path`` and rename it: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
