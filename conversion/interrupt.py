"""SIGTERM and SIGINT during a conversion: recorded by a handler, acted on between tensors."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class Interrupted(BaseException):
    """SIGTERM or SIGINT (Ctrl-C) during a conversion, raised by `check_interrupt` between tensors. A
    BaseException, so that no `except Exception` swallows it and convert()'s clean-up runs as for any
    failure. Not KeyboardInterrupt: with it,
    a Ctrl-C'd `ced-jax convert` printed this message and returned 130, yet the process still ended
    by SIGINT (status -2, measured); CPython re-sends SIGINT at exit once it has seen an unhandled
    KeyboardInterrupt, apparently somewhere inside the save's own event loop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The first SIGTERM / SIGINT received while converting (None: none). The handler only records it:
# an exception raised from a handler can land anywhere, a garbage-collection callback included, where
# Python prints it as "ignored" and the conversion would go on to replace OUT; and raised inside an
# Orbax save it leaves the save's writer threads writing into the directory being removed.
_received_signal: int | None = None


def check_interrupt() -> None:
    if _received_signal is not None:
        raise Interrupted(_received_signal)


@contextlib.contextmanager
def signals_interrupt():
    """While converting, SIGTERM and SIGINT stop the conversion at the next tensor (`check_interrupt`;
    Python's default for SIGTERM is to die on the spot, leaving the temporary directory behind).
    Further signals change nothing; SIGKILL still ends it, and the next run removes what is left."""
    global _received_signal
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    signums = (signal.SIGTERM, signal.SIGINT)

    def record(signum, frame):
        global _received_signal
        if _received_signal is None:
            _received_signal = signum
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after the current tensor\n".encode())

    _received_signal = None
    previous = {s: signal.signal(s, record) for s in signums}
    try:
        yield
    finally:
        stopping = _received_signal is not None
        for s, handler in previous.items():
            # Interrupted: the process is about to exit 128 + signal; a further Ctrl-C must not turn
            # that into a KeyboardInterrupt traceback. None: a handler set outside Python.
            signal.signal(s, signal.SIG_IGN if stopping else signal.SIG_DFL if handler is None else handler)
        _received_signal = None
