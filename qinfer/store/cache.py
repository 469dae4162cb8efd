"""Where pulled models and data live: ``$QINFER_CACHE`` or ``~/.cache/qinfer``; and the writing around it:
atomic files and folders, output checks, the free memory, fingerprints of the code a cached result came from."""

import ctypes
import errno
import functools
import glob
import hashlib
import importlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from qinfer.errors import QinferError, finished, signals_held

try:
    import fcntl
except ImportError:  # Windows: the pid alone tells whether a temp folder is in use
    fcntl = None


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
    except FileExistsError:  # the path itself is a file (a file on the way to it: errors.py's unwritable path)
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


def available_memory(cgroups: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
                     ) -> int | None:
    """Bytes the kernel could hand out now without swapping, or None where unknown: the system's
    ``MemAvailable``, or less where a memory cgroup (a container's or a job's limit) leaves less room."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    room = _cgroup_room(cgroups, membership)
    return room if free is None else free if room is None else min(free, room)


def _cgroup_room(cgroups: Path, membership: Path) -> int | None:
    """The least room under a memory limit of this process's cgroup or any cgroup above it (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``): limit - usage + the inactive page cache it can reclaim."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base, files = cgroups, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = cgroups / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        # Inside a container the cgroup's own folder is usually mounted as the root, so its path is not there.
        here = base / path.strip("/") if (base / path.strip("/")).is_dir() else base
        while True:
            room = _room(here, *files)
            if room is not None:
                rooms.append(room)
            if here == base or base not in here.parents:
                break
            here = here.parent
    return min(rooms) if rooms else None


def _room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2^63
            return None
        usage = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
        return max(0, int(limit) - usage + int(stat.get(inactive_key, 0)))
    except (OSError, ValueError):
        return None


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
    except FileExistsError:  # (a file further up: errors.py's unwritable path)
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
        if _abandoned(old, prefix):
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
        if _abandoned(stale, prefix):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _abandoned(path: Path, prefix: str) -> bool:
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


MANIFEST = ".manifest.json"  # in a folder qinfer made in the cache: {file name: bytes} of everything it wrote


def write_manifest(folder: Path) -> None:
    """Record the name and size of every file in ``folder`` (a conversion qinfer made in the cache)."""
    folder = Path(folder)
    sizes = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    write_atomic(folder / MANIFEST, json.dumps(sizes, indent=1))


def damage(folder: Path) -> str:
    """What no longer matches ``folder``'s manifest (a file missing or of another size), or '' if all does. A
    folder without a manifest (made by an older qinfer) is taken as it is if it has the weights every
    conversion writes."""
    folder = Path(folder)
    try:
        sizes = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        if not folder.is_dir():
            return f"{folder} is missing"
        return "" if (folder / "model.safetensors").is_file() else "model.safetensors is missing"
    except (OSError, ValueError):
        return f"its {MANIFEST} is unreadable"
    if not isinstance(sizes, dict):
        return f"its {MANIFEST} is unreadable"
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not the {size} written"
    return ""


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
