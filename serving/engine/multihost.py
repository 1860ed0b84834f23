"""Multi-host serving: one program on every process of a `jax.distributed` run (SPMD).

`ced-jax serve --coordinator HOST:PORT --num-processes N --process-id i --mesh ...` starts the same
command on N processes whose devices form one mesh. Every process loads the model onto the mesh and
builds the same `ced_jax.engine.Engine` (the device state). Process 0, the leader, runs the gRPC
front end, the scheduler and `JaxEngine`, and does all the host work (the Engram history, the
checks, the batches); its engine's `mirror` (`Mirror`) hands every program run, as the program's
name, its `RunOptions` and its `StepBatch` of host arrays, to the other processes before it runs
here. The followers (`follow`) run the same program on the same batch in the same order
(`Engine.run`), so each collective program runs in lockstep on all processes, every process feeding
its own shards (and gathering host-held Engram rows from its own tables). Outputs are replicated,
so the leader reads the sampled tokens from its own devices.

Transport: the distributed runtime's key-value store (the coordinator, hosted by process 0). Call n
is one value under `ced-serve/call/<follower>/<n>`, written by the leader, read (blocking) and
deleted by the follower: the program run, encoded by `encode` (no pickle), about 1 KB per decode
step for tiny without token masks. Measured on localhost, 2 processes on 2 busy CPU cores: 0.6 to 1 ms
of process 0's time per call alone, 3 ms while serving; the follower has it about 1 ms after.

Compiles: a process that loads a program from the persistent compilation cache would start it while
its peers still compile, and gloo gives up on a peer after 30 s. Inside a mirrored call every
process waits at a barrier after each executable it builds (fresh compile or cache load: JAX's
`backend_compile_duration` event, on the compiling thread before the program runs), so all start it
together.

Death of a process: followers write a heartbeat key every `HEARTBEAT_S`; `PeerWatch` on the leader
reads them and, when one stops moving for `dead_after_s`, calls back once with a line naming the
process (the server then turns NOT_SERVING and refuses work). A follower exits when the leader (and
with it the coordinator) is gone. The run is initialized with JAX's recoverability on, so that the
distributed runtime reports a dead peer to us instead of terminating the surviving processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from ced_jax.cache import StepMetadata
from ced_jax.engine import PROGRAMS, StepBatch
from ced_jax.inputs import ImageInputs, SamplingBatch
from ced_jax.options import RunOptions

log = logging.getLogger("ced_jax.multihost")

PREFIX = "ced-serve"
HEARTBEAT_S = 0.5
_STOP = "__stop__"


# ------------------------------------------------------------------------------------------ encoding
# A program run's batch (`ced_jax.engine.batch`), sent field by field.
BATCH_TYPES = {cls.__name__: cls for cls in (StepBatch, StepMetadata, SamplingBatch, ImageInputs)}


def encode(obj) -> bytes:
    """A call's arguments (None, bool, int, float, str, lists, tuples, dicts with str keys, numpy
    arrays and scalars, and the engine's batch types holding those) as bytes: a JSON header, then the
    arrays' raw bytes."""
    blobs: list[bytes] = []

    def walk(x):
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return {"n": x}
        if isinstance(x, (np.ndarray, np.generic)):
            a = np.asarray(x)
            if a.dtype.hasobject:
                raise TypeError("multihost.encode: object arrays are not supported")
            blobs.append(a.tobytes(order="C"))
            scalar = isinstance(x, np.generic)
            # ml_dtypes' types (bfloat16, float8_*) by name: their dtype.str is an anonymous "<V2".
            dtype = a.dtype.name if a.dtype.kind == "V" else a.dtype.str
            return {"a": len(blobs) - 1, "dtype": dtype, "shape": list(a.shape), "scalar": scalar}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "t": [walk(v) for v in x]}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError("multihost.encode: dict keys must be str")
            return {"d": {k: walk(v) for k, v in x.items()}}
        if type(x).__name__ in BATCH_TYPES and isinstance(x, BATCH_TYPES[type(x).__name__]):
            fields = {f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x)}
            return {"b": type(x).__name__, "f": fields}
        raise TypeError(f"multihost.encode: cannot send a {type(x).__name__}")

    header = json.dumps(walk(obj)).encode()
    sizes = [len(b) for b in blobs]
    head = json.dumps({"h": len(header), "sizes": sizes}).encode()
    return len(head).to_bytes(4, "little") + head + header + b"".join(blobs)


def decode(data: bytes):
    """The inverse of `encode`."""
    n = int.from_bytes(data[:4], "little")
    meta = json.loads(data[4 : 4 + n])
    off = 4 + n
    tree = json.loads(data[off : off + meta["h"]])
    off += meta["h"]
    arrays = []
    for size in meta["sizes"]:
        arrays.append(data[off : off + size])
        off += size

    def build(x):
        if x is None or isinstance(x, (bool, str)):
            return x
        if "n" in x:
            return x["n"]
        if "a" in x:
            name = x["dtype"]
            dtype = np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)
            a = np.frombuffer(arrays[x["a"]], dtype).reshape(x["shape"]).copy()
            return a[()] if x["scalar"] else a
        if "l" in x:
            return [build(v) for v in x["l"]]
        if "t" in x:
            return tuple(build(v) for v in x["t"])
        if "b" in x:
            return BATCH_TYPES[x["b"]](**{k: build(v) for k, v in x["f"].items()})
        return {k: build(v) for k, v in x["d"].items()}

    return build(tree)


# --------------------------------------------------------------------------------- the cluster
class Cluster:
    """This process's view of the run: its index, the process count and the distributed runtime's
    client (key-value store and barriers). Build it after `jax.distributed.initialize`."""

    def __init__(self, *, barrier_timeout_s: float = 1800.0):
        import jax
        from jax._src.distributed import global_state

        if global_state.client is None:
            raise RuntimeError("multi-host serving needs jax.distributed.initialize first")
        self.client = global_state.client
        self.process_id = jax.process_index()
        self.num_processes = jax.process_count()
        self.barrier_timeout_ms = int(barrier_timeout_s * 1000)
        self._sent = 0
        self._received = 0
        self._barriers = 0
        self.send_seconds = 0.0  # leader: time spent handing calls to the followers
        self.bytes_sent = 0  # leader: payload bytes per follower
        self.barrier_seconds = 0.0  # time spent waiting for peers after compiles
        self.lost_peer: str | None = None  # leader: PeerWatch's line once a process is gone
        _CompileBarrier.install()

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def calls_sent(self) -> int:
        return self._sent

    @property
    def compile_barriers(self) -> int:
        return self._barriers

    def followers(self) -> range:
        return range(1, self.num_processes)

    # The leader's side.
    def send(self, payload: bytes) -> None:
        t = time.perf_counter()
        n = self._sent
        self._sent += 1
        for pid in self.followers():
            self.client.key_value_set_bytes(f"{PREFIX}/call/{pid}/{n}", payload)
        self.send_seconds += time.perf_counter() - t
        self.bytes_sent += len(payload)

    def stop_followers(self) -> None:
        """Ends every follower's `follow` loop (they return 0)."""
        self.send(encode(_STOP))

    # A follower's side.
    def receive(self, poll_s: float = 1.0) -> bytes:
        """The leader's next call (blocks; a lost coordinator raises)."""
        key = f"{PREFIX}/call/{self.process_id}/{self._received}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, int(poll_s * 1000))
            except Exception as e:  # the runtime raises XlaRuntimeError; a timeout only means idle
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise
            self.client.key_value_delete(key)
            self._received += 1
            return data

    def compile_barrier(self) -> None:
        """Every process waits here after building an executable inside a mirrored call."""
        n = self._barriers
        self._barriers += 1
        t = time.perf_counter()
        self.client.wait_at_barrier(f"{PREFIX}/compiled/{n}", self.barrier_timeout_ms)
        self.barrier_seconds += time.perf_counter() - t


class _CompileBarrier:
    """One process-wide monitoring listener: after an executable is built on a thread inside
    `lockstep(cluster)`, that cluster's barrier (see the module docstring)."""

    _EVENT = "/jax/core/compile/backend_compile_duration"
    _active = threading.local()
    _installed = False
    _lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            import jax.monitoring

            def listener(event: str, duration: float, **kwargs):
                cluster = getattr(cls._active, "cluster", None)
                if event == cls._EVENT and cluster is not None:
                    cluster.compile_barrier()

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = True


class lockstep:
    """Context: compiles on this thread end at the cluster's barrier."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def __enter__(self):
        self._prev = getattr(_CompileBarrier._active, "cluster", None)
        _CompileBarrier._active.cluster = self.cluster

    def __exit__(self, *exc):
        _CompileBarrier._active.cluster = self._prev


# ------------------------------------------------------------------------------ leader / follower
def encode_run(program: str, batch: StepBatch, options: RunOptions) -> bytes:
    """One program run as bytes: its name, its options (impl by its spelling) and its batch."""
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    fields["impl"] = str(options.impl)
    return encode([program, fields, batch])


def _program_run(message) -> tuple[str, StepBatch, RunOptions]:
    """`encode_run`'s values from a decoded message; anything else raises."""
    if not (isinstance(message, list) and len(message) == 3 and message[0] in PROGRAMS):
        head = message[0] if isinstance(message, list) and message else message
        raise ValueError(f"follower: the leader sent {head!r}, which is not a program run")
    program, fields, batch = message
    return program, batch, RunOptions(**fields)


class Mirror:
    """The leader's `Engine.mirror`: before a program runs on the leader, the same run goes to every
    follower. The lock makes sending and running one step, so the followers run in the leader's order
    whichever thread calls the engine."""

    def __init__(self, cluster: Cluster):
        self._cluster = cluster
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, program: str, batch: StepBatch, options: RunOptions):
        payload = encode_run(program, batch, options)
        with self._lock, lockstep(self._cluster):
            self._cluster.send(payload)
            yield


def follow(engine, cluster: Cluster, *, heartbeat: bool = True) -> int:
    """A follower's serving loop: the leader's program runs on `engine` (a `ced_jax.engine.Engine`
    built as the leader's) until it says stop (returns 0) or is gone (raises). A run that raises here
    raises too (the process ends, and the leader turns NOT_SERVING): the leader checked every input
    before it ran, so this should not happen, and a follower that skipped a run would go on from a
    state that is no longer the leader's. heartbeat: write the key `PeerWatch` reads (and exit when
    the coordinator is gone), on a thread of its own."""
    if heartbeat:
        threading.Thread(target=_heartbeat, args=(cluster,), name="ced-heartbeat", daemon=True).start()
    while True:
        message = decode(cluster.receive())
        if message == _STOP:
            return 0
        program, batch, options = _program_run(message)
        try:
            with lockstep(cluster):
                engine.run(program, batch, options)
        except Exception as e:
            log.error("ced-jax: process %d: %s failed (%s: %s); stopping", cluster.process_id, program,
                      type(e).__name__, e)  # fmt: skip
            raise


def _heartbeat(cluster: Cluster) -> None:
    """A follower's heartbeat key; if the coordinator (process 0) is gone the process ends."""
    import os

    n = 0
    key = f"{PREFIX}/alive/{cluster.process_id}"
    while True:
        try:
            cluster.client.key_value_set(key, str(n), allow_overwrite=True)
        except Exception as e:  # noqa: BLE001
            print(
                f"ced-jax: process {cluster.process_id}: lost the coordinator (process 0): "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; exiting",
                flush=True,
            )
            os._exit(1)
        n += 1
        time.sleep(HEARTBEAT_S)


class PeerWatch:
    """On the leader: watches the followers' heartbeats; `on_lost(line)` is called once, from the
    watch thread, when one has not moved for `dead_after_s` seconds."""

    def __init__(self, cluster: Cluster, on_lost: Callable[[str], None], *, dead_after_s: float = 10.0):
        self.cluster, self.on_lost, self.dead_after_s = cluster, on_lost, dead_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ced-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        now = time.monotonic()
        last = {pid: (None, now) for pid in self.cluster.followers()}
        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            for pid, (value, since) in last.items():
                try:
                    v = self.cluster.client.key_value_try_get(f"{PREFIX}/alive/{pid}")
                except Exception:  # noqa: BLE001 - not written yet
                    v = value
                if v != value:
                    last[pid] = (v, now)
                elif now - since > self.dead_after_s:
                    line = (
                        f"ced-jax: process {pid} of {self.cluster.num_processes} stopped responding "
                        f"(no heartbeat for {now - since:.1f} s): the mesh is incomplete; health "
                        "NOT_SERVING, new requests refused"
                    )
                    self.cluster.lost_peer = line
                    self.on_lost(line)
                    return
