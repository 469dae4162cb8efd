"""One exception type for every user-facing failure.

The CLI prints ``error: <message>`` on one line and exits non-zero for a ``QinferError``; anything else
is a bug and keeps its traceback. Messages name the problem and the fix.
"""


class QinferError(Exception):
    """A problem with the user's input or environment, explained in one line."""
