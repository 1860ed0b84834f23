"""serving/work_pools.py: bounded pools shared fairly between tenants (issue 33.4).

Ordering is checked with events, not timings: a job that blocks holds its thread until released."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serving.work_pools import FairPool, PoolBusy, current_tenant, peer_tenant

pytestmark = pytest.mark.timeout(60)


class Gate:
    """Jobs that record when they start and block until opened."""

    def __init__(self):
        self.started: list[str] = []
        self.open = threading.Event()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)

    def job(self, name: str):
        def run():
            with self._cv:
                self.started.append(name)
                self._cv.notify_all()
            assert self.open.wait(30)
            return name

        return run

    def wait_started(self, n: int) -> list[str]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.started) >= n, 30), self.started
            return list(self.started)


def test_a_tenant_runs_at_most_half_the_threads_and_another_starts_at_once():
    """Tenant a queues eight slow jobs first; tenant b's job starts while all of a's are still busy or
    waiting (before: one shared pool, so b waited for a's jobs to finish)."""
    pool, gate = FairPool("prepare", 4), Gate()
    a_jobs = [pool.submit("a", gate.job(f"a{i}")) for i in range(8)]
    assert gate.wait_started(2) == ["a0", "a1"]  # a's share: half of 4
    assert pool.counts() == (2, 6)
    b = pool.submit("b", gate.job("b0"))
    assert gate.wait_started(3)[2] == "b0"
    assert not any(f.done() for f in a_jobs)
    gate.open.set()
    assert [f.result(30) for f in a_jobs] == [f"a{i}" for i in range(8)] and b.result(30) == "b0"
    # A result is set before its thread counts itself free: the counts follow a moment later.
    deadline = time.monotonic() + 30
    while pool.counts() != (0, 0):
        assert time.monotonic() < deadline, pool.counts()
        time.sleep(0.001)
    pool.close()


def test_waiting_jobs_start_round_robin_across_tenants():
    pool, gate = FairPool("prepare", 1), Gate()  # one thread: jobs run one after another
    blocker = pool.submit("x", gate.job("x"))
    gate.wait_started(1)
    futures = [pool.submit(t, gate.job(f"{t}{i}")) for t in "ab" for i in range(3)]  # a's first
    gate.open.set()
    for f in [blocker, *futures]:
        f.result(30)
    assert gate.started == ["x", "a0", "b0", "a1", "b1", "a2", "b2"]
    pool.close()


def test_a_tenant_with_max_waiting_jobs_queued_is_refused_and_others_are_not():
    pool, gate = FairPool("tokenize", 2, max_waiting=3), Gate()
    refused = []
    pool.on_refused = lambda: refused.append(1)
    running = pool.submit("a", gate.job("a-run"))
    gate.wait_started(1)
    queued = [pool.submit("a", gate.job(f"a{i}")) for i in range(3)]
    with pytest.raises(PoolBusy, match="tokenize workers"):
        pool.submit("a", gate.job("a-over"))
    assert refused == [1]  # the ced_pool_refused_total metric
    queued[0].cancel()  # a cancelled job no longer counts
    queued.append(pool.submit("a", gate.job("a3")))
    other = pool.submit("b", gate.job("b"))
    gate.open.set()
    assert other.result(30) == "b" and running.result(30) == "a-run"
    assert [f.result(30) for f in queued[1:]] == ["a1", "a2", "a3"]
    assert "a0" not in gate.started and "a-over" not in gate.started
    pool.close()


def test_async_run_passes_results_errors_and_the_tenant_and_drops_a_cancelled_job():
    pool, gate = FairPool("prepare", 2), Gate()

    def boom():
        raise ValueError("bad body")

    async def main():
        assert await pool.run("t", lambda: current_tenant()) == "t"
        with pytest.raises(ValueError, match="bad body"):
            await pool.run("t", boom)
        hold = pool.submit("t", gate.job("hold"))  # t's share (1) is taken
        gate.wait_started(1)
        waiting = asyncio.ensure_future(pool.run("t", gate.job("never")))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.open.set()
        assert hold.result(30) == "hold"
        assert await pool.run("t", lambda: "after") == "after"

    asyncio.run(main())
    assert "never" not in gate.started and current_tenant() is None
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("t", lambda: None)


def test_bad_sizes_and_peer_names():
    with pytest.raises(ValueError, match="prepare pool"):
        FairPool("prepare", 0)
    assert FairPool("one", 1).share == 1
    assert peer_tenant("ipv4:127.0.0.1:50412") == "addr:127.0.0.1"
    assert peer_tenant("ipv6:[::1]:50412") == "addr:::1"
    assert peer_tenant("unix:/tmp/sock") == "addr:unix:/tmp/sock"
