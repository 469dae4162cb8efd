"""The click classes every command-line entry point is built on (``qinfer`` and the ``python -m qinfer.evals.*``
tools): user-facing failures end as one ``Error: <message>`` line and exit status 1.

That covers a ``QinferError``, the allocator's refusal, a full disk and a file that may not be written; anything
else is a bug and keeps its traceback. SIGTERM and SIGHUP unwind a command as Ctrl-C does, so every temp folder
is removed on the way out. Every such command takes ``-h``.
"""

import errno
import importlib
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import click

from qinfer.deps import version_problem
from qinfer.errors import finished, kept, QinferError, Terminated
from qinfer.store.paths import cache_root
from qinfer.store.signals import TERMINATING, signals_held


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
                click.echo(f"Error: terminated ({signal.Signals(e.code - 128).name}); {kept()}", err=True)
            except OSError:
                pass
            raise SystemExit(e.code) from None
        except KeyboardInterrupt:
            raise _Interrupted(f"interrupted; {kept()}") from None
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
    path, root = Path(e.filename).absolute(), cache_root().absolute()
    fix = ("set QINFER_CACHE to a folder you can write to" if path == root or root in path.parents
           else "choose a folder you can write to")
    return f"cannot write {e.filename}: {e.strerror or e}; {fix}"
