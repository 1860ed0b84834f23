"""SIGTERM on a real server process: stop admitting, finish what fits in the grace period, abort the rest,
exit 0."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from serving_helpers import wait_until

from serving import client

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_graceful_shutdown_exits_zero():
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.server", "--mock", "--grace", "1.5", "--step-delay", "0.05"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line
        addr = line.split(" on ")[1].split()[0]
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
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
        wait_until(lambda: any("shutting down" in x for x in lines), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            client.generate(addr, "too late", max_tokens=2, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        short.join(20)
        long.join(20)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    short_msgs, long_msgs = results["short"], results["long"]
    assert short_msgs[-1].finish_reason == client.ced_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in short_msgs) == 8
    assert long_msgs[-1].finish_reason == client.ced_pb2.FINISH_REASON_ABORT
    assert 0 < sum(len(m.token_ids) for m in long_msgs) < 60
