"""A request's events as an async iterator (`RequestStream`, what `Scheduler.submit_async` returns) and
`collect` (a finished stream's tokens and text)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

from serving.requests import StreamEvent


class RequestStream:
    """Async iterator over one request's events; closing it early aborts the request.

    Events are produced on the scheduler thread and handed to the loop with `call_soon_threadsafe`;
    `abort` is the scheduler's (`Scheduler.abort`)."""

    def __init__(
        self,
        abort: Callable[..., bool] | None,
        request_id: str,
        identity: str,
        loop: asyncio.AbstractEventLoop,
    ):
        self._abort = abort
        self.request_id = request_id
        self.identity = identity
        self._loop = loop
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._finished = False
        self._held: StreamEvent | None = None  # an error event that waits for the tokens before it
        self._handle: object | None = None

    def _sink(self, ev: StreamEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._finished:
            raise StopAsyncIteration
        ev = self._held if self._held is not None else await self._queue.get()
        self._held = None
        # A reader slower than the engine finds several events queued: they go out as one (tokens,
        # text and log-probabilities in order, the last one's finish), so it catches up instead of
        # falling further behind. An error is never merged: what precedes it goes out first.
        while not ev.final and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if nxt.error is not None:
                self._held = nxt
                break
            ev = dataclasses.replace(
                nxt,
                token_ids=ev.token_ids + nxt.token_ids,
                text=ev.text + nxt.text,
                logprobs=ev.logprobs + nxt.logprobs,
            )
        if ev.final:
            self._finished = True
        return ev

    def close(self) -> None:
        """Aborts the request unless it already finished (client cancel or disconnect)."""
        if not self._finished:
            self._finished = True
            if self._abort is not None:
                self._abort(self.request_id, handle=self._handle, identity=self.identity)


def collect(events: Sequence[StreamEvent]) -> tuple[list[int], str, StreamEvent]:
    """Concatenated token ids and text of a finished stream, and its final event (for tests/tools)."""
    ids: list[int] = []
    text = ""
    for ev in events:
        ids.extend(ev.token_ids)
        text += ev.text
    return ids, text, events[-1]
