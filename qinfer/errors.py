"""The one exception type for every user-facing failure, and the few facts a one-line error message reports.

A ``QinferError`` is a problem with the user's input or environment; its message names the problem and the fix.
``qinfer.cli.command`` prints it as one ``Error:`` line. This module imports nothing but the standard library, so
every part (the quantizers and kernels included) can raise it without pulling in a command-line library.
"""

from pathlib import Path


# The output the running command last finished (renamed into place): an interruption after it says it is whole.
_finished: list[Path] = []


def finished(path: Path | None) -> None:
    """Record ``path`` as the command's last finished output (None: one is being written)."""
    _finished[:] = [] if path is None else [Path(path)]


def kept() -> str:
    """How an interrupted command describes what it leaves: nothing half-written, and its last finished output."""
    return "nothing half-written was kept" + (f" ({_finished[0]} is complete)" if _finished else "")


class QinferError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def check_seed(seed: int | None) -> None:
    """Refuse a ``--seed`` that ``torch.Generator.manual_seed`` cannot take (it reads a negative one modulo 2**64)."""
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise QinferError(f"--seed must be in [-2**63, 2**64 - 1] (got {seed})")


class Terminated(SystemExit):
    """Raised by SIGTERM or SIGHUP while a command runs: unwinds like Ctrl-C (every temp folder is removed on the
    way out) but is not taken for a Ctrl-C where one only stops the current reply (``qinfer chat``)."""


