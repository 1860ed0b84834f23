"""Admission of HTTP requests (serving/admission.py): the global limit, the effort-max tier's own
limit and bounded FIFO queue, cancellation, timeouts, and the gauges. Each test runs its own event loop."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from serving.admission import Admission, AdmissionLimits, TooManyRequests


async def _settle(n: int = 5) -> None:
    # Let spawned tasks run up to their first blocking await.
    for _ in range(n):
        await asyncio.sleep(0)


class Holder:
    """A request holding its admission until `done` is set; records when it got in."""

    def __init__(self, admission: Admission, tier: str, log: list | None = None, name: str = ""):
        self.admitted = asyncio.Event()
        self.done = asyncio.Event()
        self.task = asyncio.create_task(self._run(admission, tier, log, name))

    async def _run(self, admission, tier, log, name):
        async with admission.admit(tier):
            if log is not None:
                log.append(name)
            self.admitted.set()
            await self.done.wait()

    async def finish(self):
        self.done.set()
        await self.task


def test_global_limit_then_429_with_retry_after():
    async def main():
        admission = Admission(AdmissionLimits(max_concurrent=3, retry_after_s=2))
        holders = [Holder(admission, "default") for _ in range(3)]
        await _settle()
        assert all(h.admitted.is_set() for h in holders) and admission.in_flight() == 3
        with pytest.raises(TooManyRequests) as err:
            async with admission.admit("default"):
                pytest.fail("admitted beyond the global limit")
        assert err.value.retry_after_s == 2 and err.value.headers == {"Retry-After": "2"}
        assert err.value.status == 429 and err.value.reason == "concurrency"
        assert "3 in flight" in err.value.message
        # A max-effort request also counts against the global limit: it waits (no global slot free).
        waiting = Holder(admission, "max")
        await _settle()
        assert not waiting.admitted.is_set() and admission.queued() == 1
        await holders[0].finish()
        await _settle()
        assert waiting.admitted.is_set() and admission.in_flight() == 3
        for h in (*holders[1:], waiting):
            await h.finish()
        assert admission.in_flight() == 0 and admission.queued() == 0

    asyncio.run(main())


def test_full_max_queue_does_not_keep_out_a_default_request():
    async def main():
        limits = AdmissionLimits(
            max_concurrent=10, max_tier_concurrent=1, max_tier_queue=2, max_tier_retry_after_s=30
        )
        admission = Admission(limits)
        running = Holder(admission, "max")
        queued = [Holder(admission, "max") for _ in range(2)]
        await _settle()
        assert running.admitted.is_set() and admission.queued() == 2
        with pytest.raises(TooManyRequests) as err:
            async with admission.admit("max"):
                pytest.fail("admitted beyond the max-tier queue")
        assert err.value.reason == "queue_full" and err.value.retry_after_s == 30
        # The max tier is full, running and queued: a default (non-thinking) request still gets in.
        default = Holder(admission, "default")
        await _settle()
        assert default.admitted.is_set()
        assert admission.in_flight("default") == 1 and admission.in_flight("max") == 1
        for h in (running, *queued, default):
            await h.finish()
        assert admission.in_flight() == 0 and admission.queued() == 0

    asyncio.run(main())


def test_waiters_are_admitted_in_order_one_slot_at_a_time():
    async def main():
        admission = Admission(AdmissionLimits(max_tier_concurrent=1, max_tier_queue=10))
        log: list[str] = []
        first = Holder(admission, "max", log, "first")
        await _settle()
        waiters = []
        for name in "abcde":  # each enters the queue before the next is created
            waiters.append(Holder(admission, "max", log, name))
            await _settle()
        assert admission.queued() == 5 and log == ["first"]
        await first.finish()
        for i, w in enumerate(waiters):
            await _settle()
            assert w.admitted.is_set()
            assert all(not other.admitted.is_set() for other in waiters[i + 1 :])  # one slot: one at a time
            assert admission.in_flight("max") == 1
            await w.finish()
        assert log == ["first", "a", "b", "c", "d", "e"]
        assert admission.in_flight() == 0 and admission.queued() == 0

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        admission = Admission(AdmissionLimits(max_tier_concurrent=1, max_tier_queue=2))
        log: list[str] = []
        running = Holder(admission, "max", log, "running")
        a = Holder(admission, "max", log, "a")
        b = Holder(admission, "max", log, "b")
        await _settle()
        assert admission.queued() == 2
        a.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a.task
        assert admission.queued() == 1
        # Its place is free: a new waiter fits in the queue of 2 again.
        c = Holder(admission, "max", log, "c")
        await _settle()
        assert admission.queued() == 2
        await running.finish()
        await _settle()
        assert b.admitted.is_set() and not c.admitted.is_set()
        await b.finish()
        await _settle()
        await c.finish()
        assert log == ["running", "b", "c"]
        assert admission.in_flight() == 0 and admission.queued() == 0

    asyncio.run(main())


def test_a_waiter_cancelled_as_its_slot_is_handed_over_passes_it_on():
    async def main():
        admission = Admission(AdmissionLimits(max_tier_concurrent=1, max_tier_queue=2))
        log: list[str] = []
        a = b = None

        async def running():
            async with admission.admit("max"):
                log.append("running")
                await release.wait()
            # The slot went to `a` as the block exited; `a` has not run yet when it is cancelled.
            assert admission.in_flight("max") == 1 and admission.queued() == 1
            a.task.cancel()

        release = asyncio.Event()
        holder = asyncio.create_task(running())
        await _settle()
        a = Holder(admission, "max", log, "a")
        b = Holder(admission, "max", log, "b")
        await _settle()
        release.set()
        await holder
        with pytest.raises(asyncio.CancelledError):
            await a.task
        await _settle()
        assert b.admitted.is_set() and admission.in_flight("max") == 1
        await b.finish()
        assert log == ["running", "b"]
        assert admission.in_flight() == 0 and admission.queued() == 0

    asyncio.run(main())


def test_queue_timeout():
    async def main():
        limits = AdmissionLimits(max_tier_concurrent=1, max_tier_queue=2, max_tier_queue_timeout_s=0.05)
        admission = Admission(limits)
        running = Holder(admission, "max")
        await _settle()
        with pytest.raises(TooManyRequests) as err:
            async with admission.admit("max"):
                pytest.fail("admitted while the max tier was full")
        assert err.value.reason == "queue_timeout" and "0.05 s" in err.value.message
        assert admission.queued() == 0 and admission.in_flight() == 1
        await running.finish()
        assert admission.in_flight() == 0

    asyncio.run(main())


def test_an_error_inside_the_block_releases_the_slot():
    async def main():
        admission = Admission(AdmissionLimits(max_concurrent=1))
        with pytest.raises(RuntimeError):
            async with admission.admit("default"):
                raise RuntimeError("engine failed")
        assert admission.in_flight() == 0
        async with admission.admit("default"):
            assert admission.in_flight() == 1

    asyncio.run(main())


def test_gauges_and_rejection_counter():
    async def main():
        registry = CollectorRegistry()
        admission = Admission(
            AdmissionLimits(max_concurrent=5, max_tier_concurrent=1, max_tier_queue=1), registry
        )

        def gauge(name, tier):
            return registry.get_sample_value(name, {"tier": tier})

        def rejected(tier, reason):
            return registry.get_sample_value(
                "ced_http_admission_rejected_total", {"tier": tier, "reason": reason}
            )

        assert gauge("ced_http_admission_in_flight", "max") == 0 and rejected("max", "queue_full") == 0
        holders = [Holder(admission, "default"), Holder(admission, "max"), Holder(admission, "max")]
        await _settle()
        assert gauge("ced_http_admission_in_flight", "default") == 1
        assert gauge("ced_http_admission_in_flight", "max") == 1
        assert gauge("ced_http_admission_queued", "max") == 1
        assert gauge("ced_http_admission_queued", "default") == 0
        with pytest.raises(TooManyRequests):
            async with admission.admit("max"):
                pass
        assert rejected("max", "queue_full") == 1 and rejected("default", "concurrency") == 0
        for h in holders:
            await h.finish()
        assert gauge("ced_http_admission_in_flight", "default") == 0
        assert gauge("ced_http_admission_in_flight", "max") == 0
        assert gauge("ced_http_admission_queued", "max") == 0

    asyncio.run(main())


def test_bad_limits_name_the_field():
    for kwargs, field in (
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"max_tier_concurrent": 0}, "max_tier_concurrent"),
        ({"max_tier_queue": -1}, "max_tier_queue"),
        ({"retry_after_s": 1.5}, "retry_after_s"),
        ({"max_tier_queue_timeout_s": 0}, "max_tier_queue_timeout_s"),
    ):
        with pytest.raises(ValueError, match=field):
            AdmissionLimits(**kwargs)

    async def main():
        with pytest.raises(ValueError, match="tier"):
            async with Admission().admit("high"):
                pass

    asyncio.run(main())
