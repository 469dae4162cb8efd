"""Where pulled models and data live: ``$QINFER_CACHE`` or ``~/.cache/qinfer``."""

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
