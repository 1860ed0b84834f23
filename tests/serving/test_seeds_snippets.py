"""The seeds' code snippets run against `ced-jax serve tiny` with its default flags.

The four Python snippets of the deployment article (`../shared/seeds/000_*.txt`, copied verbatim into
tests/serving/seeds/snippets, since a clone has no ../shared) are run as written, with only the base
URL and the key changed: a connectivity probe, the KV estimate of a 30K-token prompt (its own 60 s
timeout), JSON output with post-validation, and 50 concurrent thinking requests with `max_tokens`
8192 (its own 180 s timeout and retries). The server gets only ports besides the defaults (gRPC and
metrics on free ones, HTTP on a free one instead of 8000), so tests can run beside each other.

Slow: about six minutes of traffic on two cores, most of it the 50 requests' thinking tokens.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SNIPPETS = REPO / "tests" / "serving" / "seeds" / "snippets"
HOSTED_URL = "https://api.deepseek.com"
HOSTED_KEY = "your-deepseek-api-key"
LOCAL_KEY = "sk-local"  # the server has no keys configured: any key is accepted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "ced_cli.main", "serve", "tiny"]
    cmd += ["--port", "0", "--metrics-port", "-1", "--http-port", str(port)]
    log = open(log_path, "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        end = time.monotonic() + 1200  # a cold start compiles ten programs (about 4 minutes here)
        while time.monotonic() < end and proc.poll() is None:
            if re.search(r"serving \S+ on ", log_path.read_text()):
                break
            time.sleep(1)
        else:
            pytest.fail(f"ced-jax serve tiny did not start:\n{log_path.read_text()[-3000:]}")
        yield f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _run(name: str, base_url: str, tmp_path, timeout: float) -> str:
    """Runs snippet `name` with the base URL and key replaced; returns what it printed."""
    source = (SNIPPETS / name).read_text()
    assert HOSTED_URL in source
    script = tmp_path / name
    script.write_text(source.replace(HOSTED_URL, base_url).replace(HOSTED_KEY, LOCAL_KEY))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPSEEK_", "DS_"))}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def test_the_long_prompt_estimate_answers_within_its_own_timeout(base_url, tmp_path):
    """30,057 prompt tokens ("部署测试。" x 2000 in the chat template) prefilled and answered within the
    snippet's 60 s (the long-prompt program: nothing else runs)."""
    out = _run("estimate_kv.py", base_url, tmp_path, timeout=300)
    result = ast.literal_eval(out.strip().splitlines()[-1])
    assert result["prompt_tokens"] > 30_000
    assert result["压缩比"] == round(3514 / 890, 2)


def test_the_probe_and_the_json_output_snippets_run(base_url, tmp_path):
    probe = _run("probe.py", base_url, tmp_path, timeout=120).splitlines()
    assert ast.literal_eval(probe[-2])["weight_requirement_GB"] > 0  # after the model's reply
    # The tiny random model reasons for all of its 1024 tokens or ends with free text: either way
    # the snippet reports its own verdict instead of crashing.
    verdict = ast.literal_eval(_run("call_json.py", base_url, tmp_path, timeout=600).strip().splitlines()[-1])
    assert verdict["ok"] or verdict["reason"] in ("invalid_json", "bad_field:name", "bad_field:score")


def test_fifty_concurrent_thinking_requests_all_complete(base_url, tmp_path):
    out = _run("concurrent_50.py", base_url, tmp_path, timeout=1200)
    assert out.strip().splitlines()[-1] == "ok=50 failed=0"
