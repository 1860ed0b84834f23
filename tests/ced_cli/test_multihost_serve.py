"""Multi-host `ced-jax serve` (serving/engine/multihost.py): 2 processes x 4 CPU devices on localhost serve
the tiny model on one (1, 4, 2) mesh; greedy completions over gRPC, several at once, are the tokens
of a one-process server on 8 devices with the same mesh shape; killing process 1 turns health
NOT_SERVING within a bound, with a log line naming the process, and no hang.

Both servers run with JAX's persistent compilation cache on (the suite's), which the multi-host
logits test (test_multihost.py) had to turn off: a process that loads its programs from the cache
used to start them while its peer still compiled, past gloo's 30 s. `serving.engine.multihost` now puts a
barrier after every executable built inside a step handed to all processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import ml_dtypes
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ced_jax.cache import StepMetadata
from ced_jax.engine import ImageInputs, SamplingBatch, StepBatch
from ced_jax.options import RunOptions
from serving import client
from serving.engine import multihost
from tests.conftest import REPO

# Small shapes: one prefill program (4 rows of 16-token chunks), one decode program (4 rows), restore.
SHAPES = ["--max-slots", "4", "--page-size", "16", "--max-context", "64", "--prefill-chunk", "16"]
MESH = ["--mesh", "expert=4,tensor=2"]
# Prompts of 3..40 tokens (one to three chunks), completed greedily at once.
PROMPTS = [[1, 17, 99], list(range(5, 45)), [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59],
           [300, 200, 100, 250, 150, 50, 25, 12]]  # fmt: skip
MAX_TOKENS = 10
START_S = 900  # loading + compiling on a loaded 2-core machine
NOT_SERVING_WITHIN_S = 40  # heartbeat silence 10 s (PeerWatch) + slack for a loaded machine


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],  # the persistent cache, on
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "PYTHONPATH": str(REPO),
    }


def _serve(extra: list[str], devices: int, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ced_cli.main", "serve", "tiny", *SHAPES, *MESH, *extra]
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(devices), cwd=REPO)


def _wait_serving(procs: list[subprocess.Popen], log_path) -> str:
    end = time.monotonic() + START_S
    while time.monotonic() < end:
        m = re.search(r"serving \S+ on (\S+)", log_path.read_text())
        if m:
            return m.group(1)
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"exited {dead[0].returncode}: {log_path.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"not serving after {START_S} s: {log_path.read_text()[-3000:]}")


def _complete_all(addr: str) -> list[list[int]]:
    """The prompts' greedy completions, all in flight at once."""

    def one(prompt):
        c = client.generate(
            addr, prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=600
        )
        assert c.finish_reason == "length", c.finish_reason
        return c.token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def one_process_tokens(tmp_path_factory) -> list[list[int]]:
    """The single-process server on 8 devices, mesh (1, 4, 2)."""
    log_path = tmp_path_factory.mktemp("one") / "serve.log"
    proc = _serve(["--port", "0", "--metrics-port", "-1", "--http-port", "0"], 8, log_path)
    try:
        addr = _wait_serving([proc], log_path)
        tokens = _complete_all(addr)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        return tokens
    finally:
        _stop([proc])


@pytest.mark.slow  # two servers load and compile the tiny model's mesh programs (several minutes on 2 cores)
@pytest.mark.timeout(2400)
def test_two_processes_serve_the_tokens_of_one_then_a_dead_peer_is_not_serving(one_process_tokens, tmp_path):
    port = _free_port()
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for pid in range(2):
        extra = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]
        extra += ["--init-timeout", "300", "--port", "0", "--metrics-port", "-1", "--http-port", "0"]
        procs.append(_serve(extra, 4, logs[pid]))
    try:
        addr = _wait_serving(procs, logs[0])
        assert "following process 0" in logs[1].read_text()
        got = _complete_all(addr)
        assert got == one_process_tokens
        assert all(len(t) == MAX_TOKENS for t in got)
        assert _health(addr) == health_pb2.HealthCheckResponse.SERVING
        # A dead process, killed while a stream runs: the stream ends (an error or ABORT, not a hang),
        # health turns NOT_SERVING within the bound, a line names the process, new requests are refused.
        stream = client.stream(addr, PROMPTS[0], max_tokens=60, temperature=0.0, ignore_eos=True, timeout=600)
        first = next(stream)
        assert first.token_ids
        procs[1].kill()
        procs[1].wait()
        killed = time.monotonic()
        ended: list = []

        def drain():
            try:
                ended.append([m.finish_reason for m in stream][-1:])
            except grpc.RpcError as e:  # the engine step failed: the stream ends with an error status
                ended.append(e.code())

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        drainer.join(NOT_SERVING_WITHIN_S)
        assert ended, f"the stream still runs {NOT_SERVING_WITHIN_S} s after process 1 died"
        assert ended[0] != [0], ended  # a finish reason (the last message) or an error status
        while _health(addr) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - killed < NOT_SERVING_WITHIN_S, logs[0].read_text()[-3000:]
            assert procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        assert re.search(r"process 1 of 2 stopped responding", logs[0].read_text())
        with pytest.raises(grpc.RpcError) as e:
            client.generate(addr, PROMPTS[0], max_tokens=2, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert procs[0].poll() is None  # still answering health, not gone and not hung
        # SIGTERM still ends the server (exit 0), which reports what handing each step over cost. It
        # must not tear down the device runtime: a worker thread waits in a collective with the dead peer.
        procs[0].send_signal(signal.SIGTERM)
        try:
            rc = procs[0].wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM did not end process 0 within 180 s: {logs[0].read_text()[-3000:]}")
        assert rc == 0, logs[0].read_text()[-3000:]
        assert "exiting without tearing down the device runtime" in logs[0].read_text()
        handed = re.search(r"handed (\d+) engine calls .*", logs[0].read_text())
        assert handed and int(handed.group(1)) > len(PROMPTS), logs[0].read_text()[-3000:]
        print(handed.group(0))
    finally:
        _stop(procs)


# ------------------------------------------------------------------ the hand-over, in one process
class _Queue:
    """A cluster whose transport is a list (the calls the leader sent, in order)."""

    process_id = 1  # the follower's

    def __init__(self):
        self.sent: list[bytes] = []
        self.barriers = 0

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)

    def stop_followers(self) -> None:
        self.send(multihost.encode("__stop__"))

    def receive(self) -> bytes:
        return self.sent.pop(0)

    def compile_barrier(self) -> None:
        self.barriers += 1


class _Recorder:
    """A follower's engine that records the program runs it gets; a negative slot fails."""

    def __init__(self):
        self.calls = []

    def run(self, program, batch, options):
        if np.any(batch.meta.slots < 0):
            raise ValueError("slot must be >= 0")
        self.calls.append((program, batch, options))


def _same(a, b) -> bool:
    if dataclasses.is_dataclass(a) or dataclasses.is_dataclass(b):
        fields = lambda x: [getattr(x, f.name) for f in dataclasses.fields(x)]
        return type(a) is type(b) and _same(fields(a), fields(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _batch(rng, rows: int, *, slots=None) -> StepBatch:
    meta = StepMetadata(
        start=np.arange(rows, dtype=np.int32) * 16,
        lens=np.ones(rows, np.int32),
        slots=np.arange(rows, dtype=np.int32) if slots is None else np.asarray(slots, np.int32),
        page_tables=rng.integers(0, 9, (rows, 3)).astype(np.int32),
        window_floor=rng.integers(0, 4, (rows, 5)).astype(np.int32),
    )
    sampling = SamplingBatch.broadcast(rows, temperature=rng.random(rows), seed=7, token_bitmask=None)
    images = ImageInputs(np.full((rows, 2), -1, np.int32), rng.random((rows, 2, 8)).astype(np.float32))
    engram = rng.integers(0, 1 << 20, (rows, 2, 1, 4)).astype(np.int32)
    return StepBatch(tokens=rng.integers(0, 512, (rows, 2)).astype(np.int32), meta=meta, engram=engram,
                     sampling=sampling, images=images)  # fmt: skip


def test_the_followers_run_the_leaders_programs_on_the_same_batches():
    queue, rng = _Queue(), np.random.default_rng(0)
    mirror = multihost.Mirror(queue)
    runs = [
        ("decode", _batch(rng, 4), RunOptions(max_logprobs=5)),
        (
            "step",
            _batch(rng, 2),
            RunOptions(impl="pallas:gpu:interpret", index_keys="reference", stop_at_layer=3),
        ),
        ("prefill_batch", _batch(rng, 3), RunOptions(step_tokens=64, capture_blocks=True)),
    ]
    for program, batch, options in runs:
        with mirror(program, batch, options):
            pass
    assert len(queue.sent) == 3
    queue.stop_followers()
    follower = _Recorder()
    assert multihost.follow(follower, queue, heartbeat=False) == 0
    assert not queue.sent
    assert _same(follower.calls, runs)


def test_a_follower_engine_ends_in_the_leaders_state():
    """A real engine as the follower: it gets only the leader's program runs (no Engram history of its
    own, no host calls), and ends in the same device state, bit for bit."""
    import jax

    import ced_jax
    from ced_jax.engine import Engine, StateShapes

    model = ced_jax.load("tiny")
    shapes = StateShapes(max_slots=4, page_size=16, num_pages=16, max_context=64)
    leader, follower = Engine(model.loaded, shapes), Engine(model.loaded, shapes)
    assert model.cfg.engram_layer_ids and leader.hasher is not None  # hash rows travel with the batch
    queue = _Queue()
    leader.mirror = multihost.Mirror(queue)
    rng = np.random.default_rng(1)
    slots, tables = np.arange(4, dtype=np.int32), np.arange(16, dtype=np.int32).reshape(4, 4)
    tokens = rng.integers(0, model.cfg.vocab_size, (4, 16)).astype(np.int32)
    n = np.array([16, 9, 0, 3], np.int32)
    greedy = SamplingBatch.broadcast(4)
    first = leader.prefill_batch(slots, tokens, n, np.zeros(4, np.int32), tables, greedy, max_logprobs=2)
    last = tokens[np.arange(4), np.maximum(n - 1, 0)]
    leader.dispatch_decode(slots, last, n, n > 0, tables, greedy, max_logprobs=2)
    jax.block_until_ready(first)
    queue.stop_followers()
    assert multihost.follow(follower, queue, heartbeat=False) == 0
    for a, b in zip(jax.tree.leaves(leader.state), jax.tree.leaves(follower.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(leader.history, follower.history)  # the history stayed on the leader


def test_a_run_that_fails_on_a_follower_stops_it():
    queue, rng = _Queue(), np.random.default_rng(0)
    with multihost.Mirror(queue)("decode", _batch(rng, 2, slots=[0, -1]), RunOptions()):
        pass
    queue.stop_followers()
    with pytest.raises(
        ValueError, match="slot must be"
    ):  # not skipped: its state would part from the leader's
        multihost.follow(_Recorder(), queue, heartbeat=False)


def test_arrays_keep_their_dtypes():
    for dtype in (np.int8, np.uint32, np.float16, np.bool_, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        a = (np.arange(12) % 5).astype(dtype).reshape(3, 4)
        (b,) = multihost.decode(multihost.encode([a]))
        assert (
            b.dtype == a.dtype
            and b.shape == a.shape
            and np.array_equal(a.astype(np.float32), b.astype(np.float32))
        )


def test_only_program_runs_are_followed():
    for message in (["reset_history", [], {}], ["read_pages", {}, None], "hello"):
        queue = _Queue()
        queue.send(multihost.encode(message))
        with pytest.raises(ValueError, match="not a program run"):
            multihost.follow(_Recorder(), queue, heartbeat=False)


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(TypeError, match="cannot send a object"):
        multihost.encode([object()])
    with pytest.raises(TypeError, match="dict keys must be str"):
        multihost.encode({1: 2})


def test_serve_multi_host_options_are_checked(capsys):
    from ced_cli.main import main

    base = ["serve", "tiny", "--port", "0", "--metrics-port", "-1", "--http-port", "0"]
    assert main([*base, "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "needs --mesh" in capsys.readouterr().err
    mesh = ["--mesh", "expert=4,tensor=2"]
    assert main([*base, *mesh, "--num-processes", "2", "--process-id", "0"]) == 2
    assert "need --coordinator" in capsys.readouterr().err
    assert (
        main([*base, *mesh, "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"]) == 2
    )
    assert "--process-id must be in [0, 2)" in capsys.readouterr().err
