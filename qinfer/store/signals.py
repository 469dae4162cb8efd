"""Signals that end a command, and holding them back across a few system calls that must not be parted."""

import signal
import threading
from contextlib import contextmanager


# The signals that end a command by unwinding it: `kill`, and SIGHUP (its terminal closed, its ssh dropped).
TERMINATING = (signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []))


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
