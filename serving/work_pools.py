"""Bounded worker pools for the work done before a request reaches the scheduler, shared fairly.

One pool per purpose (`WorkPools`): `prepare` (HTTP request preparation: parsing, rendering,
tokenizing; gRPC prompt tokenization and image pre-processing), `image_fetch` (image URL downloads,
called from a `prepare` job) and `tokenize` (gRPC Tokenize). Each has a fixed number of threads. A
tenant runs at most half of them at once (its `share`), and queued jobs start round-robin across
tenants: a tenant with many slow jobs (megabyte prompts, image URLs that trickle in) keeps at most
its share busy, and a small request of another tenant starts at once. A tenant with `max_waiting`
jobs queued in a pool gets `PoolBusy` (HTTP 429, gRPC RESOURCE_EXHAUSTED).

The tenant is what the server can hold a client to: its API key's name when keys are configured,
else its network address. The `user` field is the client's own claim; a client rotating it would
get any share it liked.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

_worker = threading.local()  # the tenant the current pool thread works for


def current_tenant() -> str | None:
    """The tenant of the job running on this thread (None outside a pool job)."""
    return getattr(_worker, "tenant", None)


class PoolBusy(Exception):
    """The tenant has `max_waiting` jobs queued in this pool already."""

    def __init__(self, pool: str, waiting: int):
        self.pool = pool
        super().__init__(
            f"too many requests of this client are waiting for the {pool} workers ({waiting}); retry later"
        )


@dataclasses.dataclass
class _Job:
    tenant: str
    fn: Callable[[], Any]
    future: concurrent.futures.Future


class FairPool:
    """`workers` threads; a tenant runs at most `share` (half of them) at once; queued jobs start
    round-robin across tenants."""

    def __init__(self, name: str, workers: int, *, max_waiting: int = 64):
        self.on_refused: Callable[[], None] | None = None  # called for each PoolBusy (a metric)
        if workers < 1 or max_waiting < 1:
            raise ValueError(
                f"{name} pool: workers and max_waiting must be >= 1, got {workers} and {max_waiting}"
            )
        self.name = name
        self.workers = workers
        self.share = max(1, workers // 2)
        self.max_waiting = max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"ced-{name}")
        self._lock = threading.Lock()
        self._free = workers
        self._running: collections.Counter[str] = collections.Counter()
        # Tenants with queued jobs, in the order they get the next free thread.
        self._waiting: collections.OrderedDict[str, collections.deque[_Job]] = collections.OrderedDict()
        self._closed = False

    def submit(self, tenant: str, fn: Callable, *args) -> concurrent.futures.Future:
        """Queues fn(*args) for `tenant` (run in a copy of the caller's context variables); PoolBusy if
        the tenant has `max_waiting` jobs queued, RuntimeError once closed."""
        ctx = contextvars.copy_context()
        job = _Job(tenant, lambda: ctx.run(fn, *args), concurrent.futures.Future())
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} pool is closed")
            queue = self._waiting.get(tenant)
            if queue is not None:
                waiting = sum(not j.future.cancelled() for j in queue)
                if waiting >= self.max_waiting:
                    if self.on_refused is not None:
                        self.on_refused()
                    raise PoolBusy(self.name, waiting)
            self._waiting.setdefault(tenant, collections.deque()).append(job)
            self._dispatch()
        return job.future

    async def run(self, tenant: str, fn: Callable, *args):
        """fn(*args) on a pool thread; cancelling the caller drops the job if it has not started."""
        return await asyncio.wrap_future(self.submit(tenant, fn, *args))

    def call(self, tenant: str, fn: Callable, *args):
        """fn(*args) on a pool thread, waited for on this thread (a job of another pool)."""
        return self.submit(tenant, fn, *args).result()

    def counts(self) -> tuple[int, int]:
        """(jobs running, jobs waiting)."""
        with self._lock:
            waiting = sum(not j.future.cancelled() for q in self._waiting.values() for j in q)
            return self.workers - self._free, waiting

    def close(self) -> None:
        """Queued jobs are cancelled; running ones finish on their threads."""
        with self._lock:
            self._closed = True
            for queue in self._waiting.values():
                for job in queue:
                    job.future.cancel()
            self._waiting.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:  # under _lock
        while self._free > 0:
            tenant = next((t for t in self._waiting if self._running[t] < self.share), None)
            if tenant is None:
                return
            queue = self._waiting[tenant]
            job = queue.popleft()
            if queue:
                self._waiting.move_to_end(tenant)
            else:
                del self._waiting[tenant]
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            self._running[tenant] += 1
            self._free -= 1
            self._executor.submit(self._work, job)

    def _work(self, job: _Job) -> None:
        _worker.tenant = job.tenant
        try:
            result = job.fn()
        except BaseException as e:
            job.future.set_exception(e)
        else:
            job.future.set_result(result)
        finally:
            _worker.tenant = None
            with self._lock:
                self._running[job.tenant] -= 1
                if not self._running[job.tenant]:
                    del self._running[job.tenant]
                self._free += 1
                if not self._closed:
                    self._dispatch()


@dataclasses.dataclass
class WorkPools:
    prepare: FairPool
    image_fetch: FairPool
    tokenize: FairPool

    @classmethod
    def from_config(cls, config) -> WorkPools:
        """The pools of a `ServeConfig` (prepare_workers, image_fetch_workers, tokenize_workers)."""
        return cls(
            prepare=FairPool("prepare", config.prepare_workers),
            image_fetch=FairPool("image-fetch", config.image_fetch_workers),
            tokenize=FairPool("tokenize", config.tokenize_workers),
        )

    def close(self) -> None:
        for pool in (self.prepare, self.image_fetch, self.tokenize):
            pool.close()

    def export(self, metrics) -> None:
        """Running / waiting jobs and refusals of each pool on `metrics` (serving.metrics.Metrics)."""
        for pool in (self.prepare, self.image_fetch, self.tokenize):
            for i, state in enumerate(("running", "waiting")):
                metrics.pool_jobs.labels(pool=pool.name, state=state).set_function(
                    lambda pool=pool, i=i: pool.counts()[i]
                )
            refused = metrics.pool_refused.labels(pool=pool.name)
            pool.on_refused = refused.inc


def peer_tenant(peer: str) -> str:
    """A gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") without its port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return f"addr:{host.strip('[]')}"
    return f"addr:{peer}"
