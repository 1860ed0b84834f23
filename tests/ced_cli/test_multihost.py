"""Multi-host through jax.distributed: 2 processes x 4 CPU devices on localhost run `ced-jax logits`
on one (1, 4, 2) mesh and give the logits of a single process.

Each process is a subprocess of the test with its own 4 fake CPU devices, a coordinator on
127.0.0.1 and a bounded timeout; cross-process collectives run over gloo (JAX's CPU default).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from ced_jax.api import load
from tests.conftest import GOLDEN_TINY_A, REPO

TIMEOUT_S = 420
PROMPT_TOKENS, DECODE_TOKENS = 12, 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(argv: list[str], tmp_path) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "4",
        "JAX_COMPILATION_CACHE_DIR": str(REPO / ".jax_cache"),
        "PYTHONPATH": str(REPO),
    }
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "-m", "ced_cli.main", *argv]
        cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]
        cmd += ["--init-timeout", "120"]
        log_path = tmp_path / f"process{pid}.log"
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        procs.append((proc, log_path))
    results = []
    try:
        for proc, log_path in procs:
            rc = proc.wait(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(proc.args, rc, log_path.read_text()))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture(scope="module")
def golden_ids():
    g = load_file(str(GOLDEN_TINY_A / "expected.safetensors"))
    return g["prompt_ids"][:PROMPT_TOKENS].tolist(), g["decode_ids"][:DECODE_TOKENS].tolist()


def test_two_processes_match_one(tmp_path, golden_ids):
    prompt, decode = golden_ids
    (tmp_path / "prompt.json").write_text(json.dumps(prompt))
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    out = tmp_path / "logits.safetensors"
    argv = ["logits", str(GOLDEN_TINY_A), "--prompt-ids", str(tmp_path / "prompt.json")]
    argv += ["--decode-ids", str(tmp_path / "decode.json"), "--out", str(out), "--mesh", "expert=4,tensor=2"]
    results = _run_two_processes(argv, tmp_path)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    assert out.exists()  # written once, by process 0
    got = load_file(str(out))
    want = load(str(GOLDEN_TINY_A)).logits(prompt, decode)
    # Same tolerance as the single-process meshes (tests/ced_jax/test_sharding.py).
    np.testing.assert_allclose(got["prefill_logits_full"], want["prefill_logits_full"], atol=1e-3, rtol=0)
    np.testing.assert_allclose(got["decode_logits"], want["decode_logits"], atol=1e-3, rtol=0)
    assert got["decode_logits"].shape == (DECODE_TOKENS, 512)


def test_distributed_options_are_checked(capsys):
    from ced_cli.main import main

    base = ["logits", str(GOLDEN_TINY_A), "--prompt-ids", "x.json", "--out", "y.safetensors"]
    assert main([*base, "--num-processes", "2"]) == 2
    assert "need --coordinator" in capsys.readouterr().err
    assert main([*base, "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"]) == 2
    assert "--process-id must be in [0, 2)" in capsys.readouterr().err
