"""Writing outputs all or nothing: a folder or file is written beside its place and renamed into it, so a reader
(or the next run, after a crash) sees the old one or the new one, never half of either; and the checks that refuse
an output before any work is done."""

import ctypes
import errno
import functools
import glob
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from qinfer.errors import finished, QinferError
from qinfer.store.paths import CACHE_OWNED, cache_root
from qinfer.store.signals import signals_held
from qinfer.store.temp import abandoned, release, temp_path


def check_output(out: Path, force: bool, source: Path | None = None) -> None:
    """Refuse an output folder before any work is done: one that exists (without ``force``); with ``force``,
    anything but a model folder (config.json) or an empty one, so a mistyped ``-o`` never replaces a home folder
    or a file; the ``source`` being read; a place no folder can be made in."""
    out = Path(out)
    try:
        out.resolve()
    except RuntimeError:  # Python 3.11 says "Symlink loop"
        raise QinferError(f"-o {out} goes through a loop of symbolic links: choose another -o") from None
    overhead = len(f"..tmp-{os.getpid()}-12345678")  # OUT is written first in .<name>.tmp-<pid>-<8 random>
    if len(os.fsencode(out.name)) + overhead > _NAME_MAX:
        raise QinferError(f"-o {out}: a name of {len(os.fsencode(out.name))} bytes is too long here (at most "
                          f"{_NAME_MAX - overhead}: it is written first in a temp folder named after it); choose a "
                          "shorter -o")
    _restore_replaced(out)
    if source is not None and out.resolve() == Path(source).resolve():
        raise QinferError(f"-o {out} is the model being read: choose another -o")
    if source is not None and force and out.resolve() in Path(source).resolve().parents:
        raise QinferError(f"-o {out} holds the model being read ({source}): --force would delete it; choose another -o")
    kept = [cache_root().resolve() / name for name in CACHE_OWNED]
    if any(out.resolve() == k or k in out.resolve().parents for k in kept):
        raise QinferError(f"-o {out} is inside qinfer's cache of pulled and converted models ({kept[0].parent}), "
                          "which qinfer manages itself: choose another -o")
    if out.exists() or out.is_symlink():
        if not force:
            raise QinferError(f"{out} already exists: choose another -o or pass --force to replace it")
        if out.is_symlink():
            raise QinferError(f"{out} is a symbolic link: --force replaces only a model folder, not a link to one; "
                              "choose another -o")
        if not out.is_dir():
            raise QinferError(f"{out} is not a folder: --force replaces only a model folder; choose another -o")
        if os.path.ismount(out):
            raise QinferError(f"{out} is a mount point, which --force cannot replace: write to a folder in it "
                              f"(-o {out / 'model'})")
        if not (out / "config.json").exists() and any(out.iterdir()):
            raise QinferError(f"{out} is a folder without a model in it (no config.json): --force replaces only a "
                              "model folder; choose another -o")
        others = sorted(p.name + "/" * p.is_dir() for p in out.iterdir() if not _model_file(p))
        if others:
            listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise QinferError(f"{out} holds more than a model ({listed}): --force would delete that too; move it out "
                              "or choose another -o")
    check_writable(out.parent, what=str(out))


_NAME_MAX = 255  # bytes in a file name: Linux's file systems, macOS, Windows (in characters)


# What a model folder consists of (qinfer's outputs, Hugging Face model folders, an eval's --out there): the only
# entries --force deletes with the folder.
_MODEL_SUFFIXES = (".safetensors", ".json", ".jinja")
_MODEL_NAMES = ("tokenizer.model", "merges.txt", "vocab.txt", "README.md", "USE_POLICY.md", ".gitattributes",
                "results.md", "pareto.png", "roofline.png")


def _model_file(path: Path) -> bool:
    # a symbolic link to one (a Hugging Face cache's snapshot) is removed, not what it points to
    return path.is_file() and (path.suffix in _MODEL_SUFFIXES or path.name in _MODEL_NAMES
                               or path.name.startswith(("LICENSE", "NOTICE")))


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
    finished(None)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # (a file further up: qinfer.cli.command's unwritable path)
        raise QinferError(f"cannot write {target}: {target.parent} is a file, not a folder; move it, or write "
                          "elsewhere") from None
    _restore_replaced(target)
    tmp = temp_path(target.parent, f".{target.name}.tmp-", folder=True)
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the finished folder gets ordinary permissions
    try:
        with naming_full_disk(target):
            yield tmp
            _sync_tree(tmp)
        if target.exists() and force:
            with signals_held():  # after the swap the old one must go: Ctrl-C waits
                if _exchange(tmp, target):  # one step: target is never missing, even under SIGKILL
                    old = tmp
                else:  # two renames, with no target between them (a kill there: the next run puts it back)
                    old = temp_path(target.parent, f".{target.name}.old-", folder=True)
                    release(old)
                    old.rmdir()
                    target.rename(old)
                    tmp.rename(target)
                finished(target)
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
        else:
            if target.exists() or target.is_symlink():
                raise _appeared(target)
            try:
                with signals_held():  # a Ctrl-C right after the rename is told OUT is complete
                    tmp.rename(target)  # an empty folder made meanwhile is replaced; a non-empty one raises
                    finished(target)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise _appeared(target) from None
                raise
    finally:
        release(tmp)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _sync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, and the folders, to the disk: what a rename then names is whole even
    after a power cut (the file system may otherwise commit the rename before the data)."""
    for path in sorted(Path(folder).rglob("*"), reverse=True) + [Path(folder)]:
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:  # a file system that cannot sync a folder
            if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        finally:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux's ``renameat2`` with ``RENAME_EXCHANGE``); False where
    the C library or the file system has no such call."""
    rename2 = getattr(_libc(), "renameat2", None)
    if rename2 is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if rename2(at_cwd, os.fsencode(os.path.abspath(a)), at_cwd, os.fsencode(os.path.abspath(b)), exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _restore_replaced(target: Path) -> None:
    """Put back the folder a replace moved aside, if its run was killed before the new one moved in (``target``
    missing, ``.<name>.old-<pid>-*`` there, that process gone); the finished new one in its temp folder is swept."""
    if target.exists() or target.is_symlink():
        return
    prefix = f".{target.name}.old-"
    for old in sorted(target.parent.glob(f"{glob.escape(prefix)}*")):
        if abandoned(old, prefix):
            old.rename(target)
            return


@contextmanager
def naming_full_disk(path: Path):
    """Raise a full disk met inside as an ``OSError`` naming ``path``: a ``write()`` that meets it names no
    file (the one-line error would say only "disk full while writing output"), a copy names its source, and a
    file in the temp folder is not where the user looks."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename != str(path):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def _appeared(target: Path) -> QinferError:
    return QinferError(f"{target} appeared while this run was writing it (another run with the same output?); "
                       "this run's result was discarded: choose another -o, or pass --force to replace it")


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to a temp file beside ``path`` and rename it: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path.parent, f".{path.name}.tmp-", folder=False)
    try:
        with naming_full_disk(path), open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename names it: a power cut leaves the old file or this one
        _readable(tmp)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        release(tmp)


def save_tensors(tensors: dict, path: Path) -> None:
    """``tensors`` as the safetensors file ``path``, with one metadata key (safetensors writes several in a
    per-process order: the same run gave other bytes) and the permissions the umask gives a new file
    (safetensors makes 0600). The file system's errors are raised as ``OSError`` naming ``path`` (safetensors
    raises its own type, which says only ``os error N``): a full disk is one line, not a traceback."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    _readable(path)


def _readable(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


