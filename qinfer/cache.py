"""Where pulled models and data live: ``$QINFER_CACHE`` or ``~/.cache/qinfer``; and the writing around it:
atomic files and folders, output checks, the free memory, fingerprints of the code a cached result came from."""

import hashlib
import importlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from qinfer.errors import QinferError


def cache_root() -> Path:
    """The cache folder's path (not made)."""
    return Path(os.environ.get("QINFER_CACHE") or Path.home() / ".cache" / "qinfer").expanduser()


def cache_dir() -> Path:
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


def available_memory() -> int | None:
    """Bytes the kernel could hand out now without swapping (``MemAvailable``), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_output(out: Path, force: bool, source: Path | None = None) -> None:
    """Refuse an output folder before any work is done: one that exists (without ``force``); with ``force``,
    anything but a model folder (config.json) or an empty one, so a mistyped ``-o`` never replaces a home folder
    or a file; the ``source`` being read; a place no folder can be made in."""
    out = Path(out)
    if source is not None and out.resolve() == Path(source).resolve():
        raise QinferError(f"-o {out} is the model being read: choose another -o")
    if out.exists() or out.is_symlink():
        if not force:
            raise QinferError(f"{out} already exists: choose another -o or pass --force to replace it")
        if not out.is_dir() or out.is_symlink():
            raise QinferError(f"{out} is not a folder: --force replaces only a model folder; choose another -o")
        if not (out / "config.json").exists() and any(out.iterdir()):
            raise QinferError(f"{out} is a folder without a model in it (no config.json): --force replaces only a "
                              "model folder; choose another -o")
    check_writable(out.parent, what=str(out))


def check_writable(folder: Path, what: str | None = None, option: str = "-o") -> None:
    """Check ``folder`` can be made (with its parents) and written in, or refuse in one line. Folders it had to
    make are removed again, so a run that fails later leaves nothing behind; the run makes them when it writes."""
    folder = Path(folder)
    made = [p for p in (folder.absolute(), *folder.absolute().parents) if not p.exists()]
    below = (folder.absolute(), *folder.absolute().parents)[len(made)]  # the deepest that exists
    if not below.is_dir():
        raise QinferError(f"cannot write {what or folder}: {below} is a file, not a folder; choose an {option} in a "
                          "folder you can write to")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=".probe-", dir=folder)).rmdir()
    except OSError as e:
        raise QinferError(f"cannot write {what or folder}: {e.strerror or e}; choose an {option} in a folder you can "
                          "write to") from None
    finally:
        for p in made:  # deepest first
            try:
                p.rmdir()
            except OSError:
                break


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
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
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


def source_fingerprint(modules: tuple[str, ...], package: str) -> str:
    """sha256 over the source files of ``modules`` and of every module in ``package`` (by file name and bytes):
    a cached result keyed on it is redone after any change to the code that produced it."""
    folder = Path(importlib.import_module(package).__file__).parent
    files = [Path(importlib.import_module(m).__file__) for m in modules] + sorted(folder.glob("*.py"))
    files += sorted(folder.glob("*.c"))  # C kernels built at first use
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
