"""One exception type for every user-facing failure, and the click classes that print it.

Commands built on ``Group`` or ``Command`` (``qinfer`` itself and the ``python -m qinfer.evals.*`` tools) print
``Error: <message>`` on one line and exit with status 1 for a ``QinferError``, for the allocator's refusal, for a
full disk and for a file that may not be written; anything else is a bug and keeps its traceback. Messages
name the problem and the fix. Every such command takes ``-h``.
"""

import errno
import importlib
import json
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import click

from qinfer.deps import version_problem

# The signals that end a command by unwinding it: `kill`, and SIGHUP (its terminal closed, its ssh dropped).
TERMINATING = (signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []))


# The output the running command last finished (renamed into place): an interruption after it says it is whole.
_finished: list[Path] = []


def finished(path: Path | None) -> None:
    """Record ``path`` as the command's last finished output (None: one is being written)."""
    _finished[:] = [] if path is None else [Path(path)]


def _kept() -> str:
    return "nothing half-written was kept" + (f" ({_finished[0]} is complete)" if _finished else "")


class QinferError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def read_text(path: Path, fix: str, encoding: str = "utf-8") -> str:
    """``path``'s text, or one line naming why it cannot be read, ending in ``fix``. A missing file raises
    FileNotFoundError, which callers that have their own words for it catch."""
    try:
        return Path(path).read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise QinferError(f"{path} is not UTF-8 text (byte {e.start}): {fix}") from None
    except FileNotFoundError:
        raise
    except OSError as e:  # a directory, a file this user may not read, an I/O error
        raise QinferError(f"{path} cannot be read ({e.strerror or e}): make it a readable file, or {fix}") from None


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in the UTF-8 file ``path``, or one line naming what is wrong with it, ending in ``fix``."""
    try:
        value = json.loads(read_text(path, fix))
    except json.JSONDecodeError as e:
        raise QinferError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): {fix}") from None
    if not isinstance(value, dict):
        raise QinferError(f"{path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value


def check_seed(seed: int | None) -> None:
    """Refuse a ``--seed`` that ``torch.Generator.manual_seed`` cannot take (it reads a negative one modulo 2**64)."""
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise QinferError(f"--seed must be in [-2**63, 2**64 - 1] (got {seed})")


class _OneLineErrors:
    """Turns user-facing failures raised while a click command runs into one ``Error: ...`` line; ``-h`` is
    ``--help``."""

    def __init__(self, *args, context_settings=None, **kwargs):
        settings = {"help_option_names": ["-h", "--help"], **(context_settings or {})}
        super().__init__(*args, context_settings=settings, **kwargs)

    def main(self, *args, **kwargs):
        with _forgiving_stderr():  # the Error line is written after invoke, by click: covered too
            return super().main(*args, **kwargs)

    def invoke(self, ctx):
        finished(None)
        with _termination_unwinds():
            return self._invoke(ctx)

    def _invoke(self, ctx):
        try:
            problem = version_problem()
            if problem is not None:
                raise QinferError(problem)
            return super().invoke(ctx)
        except Terminated as e:
            try:  # after a SIGHUP the terminal may be gone: the exit status still says it
                click.echo(f"Error: terminated ({signal.Signals(e.code - 128).name}); {_kept()}", err=True)
            except OSError:
                pass
            raise SystemExit(e.code) from None
        except KeyboardInterrupt:
            raise _Interrupted(f"interrupted; {_kept()}") from None
        except QinferError as e:
            raise click.ClickException(str(e)) from None
        except (MemoryError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not _out_of_memory(e):
                raise
            raise click.ClickException(f"out of memory{_request(e)}: {_LESS}") from None
        except OSError as e:
            if e.errno == errno.ENOMEM:  # a map the address-space limit (ulimit -v) or strict overcommit refused
                raise click.ClickException(f"out of memory{_request(e)}: {_LESS}") from None
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                where = e.filename or "output"
                full = "disk full" if e.errno == errno.ENOSPC else "disk quota exceeded"
                raise click.ClickException(f"{full} while writing {where}: free space and retry") from None
            if e.errno == errno.EFBIG:
                raise click.ClickException(
                    f"{e.filename or 'a file'} grew past the largest file this file system or `ulimit -f` allows: "
                    "write to another file system, or raise the limit") from None
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR) and e.filename:
                raise click.ClickException(_unwritable(e)) from None
            raise


class _Forgiving:
    """stderr that stops writing, not the command, once no one reads it (``2>&1 | head``, a closed log): notes
    and progress bars are not worth a run."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def _try(self, call, *args):
        if not self._gone:
            try:
                return call(*args)
            except OSError as e:
                if e.errno not in (errno.EPIPE, errno.EBADF):
                    raise
                self._gone = True
        return None

    def write(self, text: str) -> int:
        self._try(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._try(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def _forgiving_stderr():
    real = sys.stderr
    if isinstance(real, _Forgiving):
        yield
        return
    if real is None:  # started with no stderr at all (its descriptor closed): Python has none to write to
        with open(os.devnull, "w") as sink:
            sys.stderr = sink
            try:
                yield
            finally:
                sys.stderr = real
        return
    sys.stderr = _Forgiving(real)
    try:
        yield
    finally:
        if isinstance(sys.stderr, _Forgiving):
            sys.stderr = real


class Terminated(SystemExit):
    """Raised by SIGTERM or SIGHUP while a command runs: unwinds like Ctrl-C (every temp folder is removed on the
    way out) but is not taken for a Ctrl-C where one only stops the current reply (``qinfer chat``)."""


class _Interrupted(click.ClickException):
    exit_code = 128 + signal.SIGINT

    def show(self, file=None):
        """At a terminal, the ``^C`` it echoed ends the line first, so the message starts one of its own."""
        file = file or sys.stderr
        if file.isatty():
            click.echo(file=file)
        super().show(file)


@contextmanager
def _termination_unwinds():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated(128 + signum)

    # a signal the command was started ignoring stays ignored (`nohup qinfer quantize ...` survives a logout)
    previous = {sig: signal.signal(sig, terminate) for sig in TERMINATING if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP back for a few system calls that must not be parted, then deliver them."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, *TERMINATING)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in caught:
            signal.raise_signal(sig)


def _import_torch() -> None:
    """Import torch with SIGINT, SIGTERM and SIGHUP held back until it is done: one handled while its C++
    extension initialises aborts the process (pybind11's terminate: a core dump, no Error line, exit 134)."""
    with signals_held():
        importlib.import_module("torch")


class _Subcommand(click.Command):
    def invoke(self, ctx):
        _import_torch()  # after its options are parsed: `qinfer CMD --help` stays quick
        return super().invoke(ctx)


class Command(_OneLineErrors, click.Command):
    """A click command whose user-facing failures end as one line (``@click.command(cls=Command)``)."""

    def _invoke(self, ctx):
        _import_torch()
        return super()._invoke(ctx)


class Group(_OneLineErrors, click.Group):
    """A click group whose commands' user-facing failures end as one line."""

    command_class = _Subcommand


_LESS = ("close other programs, or ask for less (quantize: fewer --samples or a shorter --seq-len; eval: a smaller "
         "--max-tokens)")


def _out_of_memory(e: RuntimeError) -> bool:
    """Whether a RuntimeError is an allocator's refusal (torch's CPU and CUDA allocators raise these)."""
    text = str(e)
    return type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or "out of memory" in text


def _request(e: BaseException) -> str:
    """' (a request for 2.0 GiB)' when the allocator's message says how much it was asked for."""
    asked = re.search(r"allocate (\d+) bytes", str(e))
    return f" (a request for {int(asked.group(1)) / (1 << 30):.1f} GiB)" if asked else ""


def _unwritable(e: OSError) -> str:
    """One line for a file or folder that could not be written: where, why, and the fix (the cache's own
    folder: ``QINFER_CACHE``)."""
    from qinfer.store.cache import cache_root  # cache imports this module

    path, root = Path(e.filename).absolute(), cache_root().absolute()
    fix = ("set QINFER_CACHE to a folder you can write to" if path == root or root in path.parents
           else "choose a folder you can write to")
    return f"cannot write {e.filename}: {e.strerror or e}; {fix}"
