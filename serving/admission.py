"""Admission of HTTP requests: a global concurrency limit, and a tier of its own for effort `max`.

The hosted API limits each account to 2500 concurrent deepseek-flash requests, counted from when a
request is sent until its response is complete, and answers 429 beyond that (api-surface.md §14); a
request here is admitted the same way (`AdmissionLimits.max_concurrent`, no queue: a default request
beyond the limit is answered at once with `TooManyRequests`, which the front end turns into 429 with
`Retry-After`).

Requests at reasoning effort `max` hold a slot far longer than others (the seeds: "the max tier
occupies a single request for a long time, so set aside a separate restricted queue to avoid dragging
down the overall SLA"). They pass through a tier of their own:
- at most `max_tier_concurrent` of them run at once (each also holds a global slot while it runs);
- beyond that they wait in a FIFO queue of at most `max_tier_queue` entries, and a full queue answers
  `TooManyRequests` at once;
- a waiting request holds no global slot, so a full max-tier queue never keeps a default request out;
- a waiter is admitted when both a max-tier slot and a global slot are free, oldest first; it gives up
  after `max_tier_queue_timeout_s` (the hosted API drops a request whose inference has not started
  after 10 minutes, §1) with `TooManyRequests`;
- a waiter whose client goes away (its task is cancelled) leaves the queue, and a slot handed to it in
  the same instant is passed on to the next waiter.
Default requests never queue and never wait for max-tier waiters, so under a constant load of default
requests the max tier can be kept waiting until its timeout: the tier exists to protect the rest from
it, not the reverse.

Everything runs on the server's event loop (no locks: no await between a check and its update).
Metrics: `ced_http_admission_in_flight{tier}`, `ced_http_admission_queued{tier}` (gauges) and
`ced_http_admission_rejected_total{tier, reason}` (reason: concurrency, queue_full, queue_timeout).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Literal, NoReturn

from prometheus_client import CollectorRegistry, Counter, Gauge

from serving.flags import SERVER, flag, named

Tier = Literal["default", "max"]
TIERS: tuple[str, ...] = ("default", "max")
REASONS: tuple[str, ...] = ("concurrency", "queue_full", "queue_timeout")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    """Concurrency limits of the HTTP API (a frozen config; `ServeConfig` nests it)."""

    max_concurrent: int = flag(
        2500,
        "--http-max-concurrent",
        "HTTP requests in flight; beyond: 429 with Retry-After (the hosted API's limit by default)",
        group=SERVER,
    )  # all tiers (the hosted API's deepseek-flash limit)
    # Effort-max requests running at once. A max-effort answer can think for 100K+ tokens, minutes of
    # decode here, so the default keeps most of the decode batch (ServeConfig.max_slots = 32) for the rest.
    max_tier_concurrent: int = flag(
        8,
        "--max-effort-concurrent",
        "HTTP requests at reasoning effort max running at once (their own tier)",
        group=SERVER,
    )
    max_tier_queue: int = flag(
        64, "--max-effort-queue", "effort-max requests waiting for their tier; beyond: 429", group=SERVER
    )  # more are refused at once
    max_tier_queue_timeout_s: float | None = 600.0  # None: wait as long as the client does
    # Retry-After (whole seconds, RFC 9110) when the global limit is full: slots free as answers finish.
    retry_after_s: int = 1
    # Retry-After for a refused effort-max request: its tier frees a slot only when a long answer ends.
    max_tier_retry_after_s: int = 30

    def __post_init__(self):
        for name in ("max_concurrent", "max_tier_concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"admission limits: {named(self, name)} must be >= 1, got {getattr(self, name)}"
                )
        if self.max_tier_queue < 0:
            queue = named(self, "max_tier_queue")
            raise ValueError(f"admission limits: {queue} must be >= 0, got {self.max_tier_queue}")
        for name in ("retry_after_s", "max_tier_retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"admission limits: {name} must be a whole number of seconds >= 0, got {value!r}"
                )
        if self.max_tier_queue_timeout_s is not None and not self.max_tier_queue_timeout_s > 0:
            timeout = self.max_tier_queue_timeout_s
            raise ValueError(f"admission limits: max_tier_queue_timeout_s must be > 0 or None, got {timeout}")


class TooManyRequests(Exception):
    """A request refused at admission: 429 with `Retry-After: retry_after_s` (see `headers`)."""

    status = 429

    def __init__(self, message: str, *, retry_after_s: int, tier: Tier, reason: str):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.tier = tier
        self.reason = reason

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Admission:
    """The admission state of one server; `async with admission.admit(tier):` around a request's life."""

    def __init__(self, limits: AdmissionLimits | None = None, registry: CollectorRegistry | None = None):
        self.limits = limits or AdmissionLimits()
        self._in_flight = dict.fromkeys(TIERS, 0)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        registry = registry if registry is not None else CollectorRegistry()
        self._in_flight_gauge = Gauge(
            "ced_http_admission_in_flight",
            "HTTP requests admitted and not finished.",
            ["tier"],
            registry=registry,
        )
        self._queued_gauge = Gauge(
            "ced_http_admission_queued", "HTTP requests waiting for admission.", ["tier"], registry=registry
        )
        self._rejected = Counter(
            "ced_http_admission_rejected", "HTTP requests refused at admission (429).", ["tier", "reason"],
            registry=registry,
        )  # fmt: skip
        for tier in TIERS:
            self._in_flight_gauge.labels(tier=tier).set(0)
            self._queued_gauge.labels(tier=tier).set(0)
            for reason in REASONS:
                self._rejected.labels(tier=tier, reason=reason)

    # Read-only views for tests and /health.
    def in_flight(self, tier: Tier | None = None) -> int:
        return sum(self._in_flight.values()) if tier is None else self._in_flight[tier]

    def queued(self) -> int:
        return len(self._waiters)  # cancelled waiters leave it at once (`_drop`)

    @contextlib.asynccontextmanager
    async def admit(self, tier: Tier) -> AsyncIterator[None]:
        """Hold an admission for the body of the block; TooManyRequests if refused (nothing held)."""
        if tier not in TIERS:
            raise ValueError(f"admission tier must be one of {TIERS}, got {tier!r}")
        if tier == "default":
            if not self._global_free():
                self._refuse(
                    "default",
                    "concurrency",
                    f"too many concurrent requests: {self.limits.max_concurrent} in flight "
                    "(the limit: --http-max-concurrent)",
                )
            self._take("default")
        else:
            await self._admit_max()
        try:
            yield
        finally:
            self._release(tier)

    async def _admit_max(self) -> None:
        limits = self.limits
        if not self._waiters and self._max_free():
            self._take("max")
            return
        if self.queued() >= limits.max_tier_queue:
            self._refuse(
                "max",
                "queue_full",
                f"too many reasoning_effort 'max' requests: {self.in_flight('max')} running (limit "
                f"{limits.max_tier_concurrent}) and {self.queued()} waiting (limit {limits.max_tier_queue})",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._publish_queue()
        try:
            async with asyncio.timeout(limits.max_tier_queue_timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over (by `_wake`) before the cancellation reached us: pass it on.
                self._release("max")
            else:
                waiter.cancel()
                self._drop(waiter)
            if isinstance(exc, TimeoutError):
                self._refuse(
                    "max",
                    "queue_timeout",
                    f"a reasoning_effort 'max' request waited {limits.max_tier_queue_timeout_s:g} s for "
                    f"admission; {limits.max_tier_concurrent} such requests run at once",
                )
            raise

    def refuse_if_full(self) -> None:
        """TooManyRequests now if the global limit is full: checked before a request's body is read
        and prepared, so that an overloaded server answers 429 without doing that work first (the
        request still takes its admission after preparation, when its tier is known)."""
        if not self._global_free():
            self._refuse(
                "default",
                "concurrency",
                f"too many concurrent requests: {self.limits.max_concurrent} in flight "
                "(the limit: --http-max-concurrent)",
            )

    def _global_free(self) -> bool:
        return self.in_flight() < self.limits.max_concurrent

    def _max_free(self) -> bool:
        return self._global_free() and self._in_flight["max"] < self.limits.max_tier_concurrent

    def _take(self, tier: Tier) -> None:
        self._in_flight[tier] += 1
        self._in_flight_gauge.labels(tier=tier).set(self._in_flight[tier])

    def _release(self, tier: Tier) -> None:
        self._in_flight[tier] -= 1
        self._in_flight_gauge.labels(tier=tier).set(self._in_flight[tier])
        self._wake()

    def _wake(self) -> None:
        # Hand free slots to the oldest waiters; the slot is taken here, on the waiter's behalf, so no
        # request that arrives before the waiter resumes can take it.
        while self._waiters and self._max_free():
            waiter = self._waiters.popleft()
            if waiter.done():  # cancelled, not yet dropped
                continue
            self._take("max")
            waiter.set_result(None)
        self._publish_queue()

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        self._publish_queue()

    def _publish_queue(self) -> None:
        self._queued_gauge.labels(tier="max").set(self.queued())

    def _refuse(self, tier: Tier, reason: str, message: str) -> NoReturn:
        self._rejected.labels(tier=tier, reason=reason).inc()
        retry = self.limits.max_tier_retry_after_s if tier == "max" else self.limits.retry_after_s
        raise TooManyRequests(
            f"{message}; retry after {retry} s", retry_after_s=retry, tier=tier, reason=reason
        )
