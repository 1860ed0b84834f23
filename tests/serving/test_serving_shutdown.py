"""SIGTERM on a real server process: stop admitting, finish what fits in the grace period, abort the rest,
exit 0; a second signal ends the grace period at once."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import wait_until

from serving import client

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


class MockServerProcess:
    """`python -m serving.testing ...` (the mock server) with its stdout lines collected on a thread."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.testing", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
        ).start()
        wait_until(lambda: self._ready_line() or self.proc.poll() is not None, timeout=60)
        line = self._ready_line()
        assert line, self.lines
        self.addr = line.split(" on ")[1].split()[0]

    def _ready_line(self) -> str | None:
        return next((x for x in self.lines if x.startswith("ced-jax serving")), None)

    def saw(self, text: str) -> bool:
        return any(text in x for x in self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigterm_graceful_shutdown_exits_zero():
    server = MockServerProcess("--grace", "1.5", "--step-delay", "0.05")
    try:
        addr, proc = server.addr, server.proc
        results = {"short": [], "long": []}

        def consume(name, **kw):
            for msg in client.stream(addr, "shutdown test", temperature=0.0, timeout=30, **kw):
                results[name].append(msg)

        short = threading.Thread(target=consume, args=("short",), kwargs=dict(max_tokens=8))
        long = threading.Thread(target=consume, args=("long",), kwargs=dict(max_tokens=60))
        short.start()
        long.start()
        info = client.model_info(addr)
        assert info.limits.max_slots == 4
        # both streams are running (the mock server runs 20 steps/s, so "short" needs ~0.5 s more)
        wait_until(lambda: results["short"] and results["long"])
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: server.saw("shutting down"), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            client.generate(addr, "too late", max_tokens=2, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        short.join(20)
        long.join(20)
        assert proc.wait(timeout=30) == 0
    finally:
        server.close()
    short_msgs, long_msgs = results["short"], results["long"]
    assert short_msgs[-1].finish_reason == client.ced_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in short_msgs) == 8
    assert long_msgs[-1].finish_reason == client.ced_pb2.FINISH_REASON_ABORT
    assert 0 < sum(len(m.token_ids) for m in long_msgs) < 60


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_ends_the_grace_period_at_once(second):
    # A 60-token stream at 0.2 s a step would need 12 s; the grace period is 60 s. Only the second
    # signal can end the process within the few seconds allowed below.
    server = MockServerProcess("--grace", "60", "--step-delay", "0.2")
    try:
        msgs = []
        stream = threading.Thread(
            target=lambda: msgs.extend(client.stream(server.addr, "long", max_tokens=60, timeout=60))
        )
        stream.start()
        wait_until(lambda: msgs)
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: server.saw("shutting down"), timeout=10)
        with grpc.insecure_channel(server.addr) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert server.proc.poll() is None  # still in the grace period
        t = time.monotonic()
        server.proc.send_signal(second)
        assert server.proc.wait(timeout=10) == 0
        elapsed = time.monotonic() - t
        stream.join(10)
    finally:
        server.close()
    assert elapsed < 5.0, elapsed
    assert server.saw("second signal")
    assert msgs[-1].finish_reason == client.ced_pb2.FINISH_REASON_ABORT
    assert 0 < sum(len(m.token_ids) for m in msgs) < 60
