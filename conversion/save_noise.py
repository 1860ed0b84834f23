"""Quiet the noise an Orbax save makes around a failure, so the conversion's one-line error stands alone.

Orbax warns on every partial save of a non-OCDBT checkpoint; when a save fails (a full disk) its worker
threads log the failure with tracebacks, TensorStore prints asyncio's "Event loop is closed" from its
own threads for the writes still in flight, and asyncio logs the futures nobody retrieved. Each filter
drops only its own kind of record.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading


class QuietNonOcdbtMerge(logging.Filter):
    """Orbax warns on every partial save of a non-OCDBT checkpoint that there is nothing to merge; and
    when a save fails (a full disk), each of its worker threads logs the failure with a traceback
    before the same error reaches the conversion, which reports it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Skipping merge of OCDBT checkpoints" in message:
            return False
        return not (
            record.levelno >= logging.ERROR and "_SignalingThread.run() raised an exception" in message
        )


class ClosedLoopTracebacksDropped:
    """sys.stderr while converting. When a save fails (a full disk), TensorStore finishes the writes
    still in flight after Orbax has closed the save's event loop, and each completion prints a
    traceback of asyncio's "Event loop is closed" from its own thread (10-26 of them measured, written
    a piece at a time and interleaved between threads) before the conversion reports the failure in
    one line. Other threads' output is taken a line at a time and the lines of that traceback are
    dropped; everything else, and all of the main thread's output (the progress bar), is written
    through as it comes."""

    _DROPPED = re.compile(
        r"Traceback \(most recent call last\):"
        r'|  File ".*[/\\]asyncio[/\\]base_events\.py", line \d+, in (call_soon_threadsafe|_check_closed)'
        r"|    self\._check_closed\(\)"
        r"|    raise RuntimeError\('Event loop is closed'\)"
        r"|RuntimeError: Event loop is closed"
    )

    def __init__(self, stream):
        self._stream = stream
        self._partial: dict[int, str] = {}  # a thread's text since its last newline
        self._lock = threading.Lock()
        self.dropped = 0

    def write(self, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            return self._stream.write(text)
        with self._lock:
            thread = threading.get_ident()
            *lines, rest = (self._partial.pop(thread, "") + text).split("\n")
            if rest:
                self._partial[thread] = rest
            for line in lines:
                if self._DROPPED.fullmatch(line):
                    self.dropped += 1
                else:
                    self._stream.write(line + "\n")
        return len(text)

    def leftovers(self) -> str:
        with self._lock:
            return "".join(self._partial.values())

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def closed_loop_tracebacks_dropped():
    logging.getLogger("asyncio").addFilter(_LEFTOVER_SAVE_ERRORS)  # kept: they come at collection
    previous = sys.stderr
    sys.stderr = quiet = ClosedLoopTracebacksDropped(previous)
    try:
        yield
    finally:
        sys.stderr = previous
        previous.write(quiet.leftovers())


class _LeftoverSaveErrors(logging.Filter):
    """asyncio's "exception was never retrieved" records for the futures of a failed save that wrote
    into the conversion's temporary directory, logged when they are collected (after the one-line
    error, measured); the failure is the one already reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("exception was never retrieved" in message and ".converting-" in message)


_LEFTOVER_SAVE_ERRORS = _LeftoverSaveErrors()  # one instance: adding it again changes nothing
