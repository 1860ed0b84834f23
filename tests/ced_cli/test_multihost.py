"""Multi-host through jax.distributed: 2 processes x 4 CPU devices on localhost run `ced-jax logits`
on one (1, 4, 2) mesh and give the results of a single process, in mode A of PARITY.md.

Each process is a subprocess of the test with its own 4 fake CPU devices, a coordinator on
127.0.0.1 and a bounded timeout; cross-process collectives run over gloo (JAX's CPU default).

Why mode A and not free-running logits: the chaotic tiny model turns any fp32 summation-order
difference into O(1) logit differences. Measured free-running (first 12 prompt tokens + 2 decode
tokens): 38 % of the prefill logits off by > 1e-3 (max 1.12) from token 8 on (token 4: 5.5e-3),
while the only flipped top-k / expert decision is one expert id (layer 7, token 10): the early
divergence comes from rounding points (bf16 / FP8), which are discrete decisions too.

Mode A (the fixture's decisions replayed, every block input patched, via the CLI's `--replay` /
`--patch` files) leaves only reduction order. Tolerance, as on the single-process meshes
(tests/ced_jax/test_sharding.py): decisions identical, each block output within 1e-4 relative L2,
logits within 1e-3 absolute; except that the head's input (final hc collapse + norm, rounded to
bf16 after the last block) may flip one bf16 rounding: at most 1 prefill row may exceed 1e-3, and
none 1e-2. Measured (2 x 4 devices, mesh (1, 4, 2)): decisions identical, every block output and
the decode logits bit-identical, 99 of 100 prefill rows bit-identical; row 98 off by 3.4e-3 max,
which is one element of its final hidden vector one bf16 ulp apart (-1.2266 vs -1.2344).

The subprocesses run with the suite's persistent compilation cache. Only process 0 writes entries
(and the key differs per process), so process 0 loads its programs in seconds while process 1
compiles for a minute; gloo gives up on a peer after 30 s (`Gloo context initialization failed`),
so the CLI puts a barrier of all processes after every compile (`ced_cli.options.lockstep_compiles`,
serving/engine/multihost.py), and process 0 waits there for its peer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ced_jax.api import load
from tests.ced_jax.test_parity import _patch, _replay, assert_mode_a_gate, mode_a_metrics
from tests.ced_jax.test_sharding import MODE, _check_against_single
from tests.conftest import GOLDEN_TINY_A, REPO

TIMEOUT_S = 900  # each process; about 7 min on 2 vCPUs, more on a busy machine


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
        "JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],  # on: see the module docstring
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
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
def golden():
    return load_file(str(GOLDEN_TINY_A / "expected.safetensors"))


@pytest.mark.slow  # minutes on 2 vCPUs: process 1 always compiles (only process 0 writes the cache)
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_two_processes_match_one(tmp_path, golden):
    g = golden
    model = load(str(GOLDEN_TINY_A))
    replay, patch = _replay(g, model.cfg, MODE), _patch(g, MODE)
    save_file({k: np.ascontiguousarray(v) for k, v in replay.items()}, str(tmp_path / "replay.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in patch.items()}, str(tmp_path / "patch.safetensors"))
    (tmp_path / "prompt.json").write_text(json.dumps(g["prompt_ids"].tolist()))
    (tmp_path / "decode.json").write_text(json.dumps(g["decode_ids"].tolist()))
    out, cap = tmp_path / "logits.safetensors", tmp_path / "capture.safetensors"
    argv = ["logits", str(GOLDEN_TINY_A), "--prompt-ids", str(tmp_path / "prompt.json")]
    argv += ["--decode-ids", str(tmp_path / "decode.json"), "--index-k-mode", MODE]
    argv += ["--replay", str(tmp_path / "replay.safetensors"), "--patch", str(tmp_path / "patch.safetensors")]
    argv += ["--out", str(out), "--capture", str(cap), "--mesh", "expert=4,tensor=2"]
    results = _run_two_processes(argv, tmp_path)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    assert out.exists() and cap.exists()  # written once, by process 0
    got = {**load_file(str(out)), **load_file(str(cap))}
    assert got["decode_logits"].shape == (len(g["decode_ids"]), model.cfg.vocab_size)
    assert got["prefill_block_output"].shape == g["prefill_block_input"].shape
    # The same mode-A run in this process, on one device.
    want = model.logits(
        g["prompt_ids"], g["decode_ids"], index_k_mode=MODE, replay=replay, patch=patch, capture=True
    )
    _check_against_single(got, want)
    # And the two-process run passes PARITY.md's mode-A gate against DeepSeek's reference itself.
    assert_mode_a_gate(mode_a_metrics(model, g, MODE, res=got))


def test_distributed_options_are_checked(capsys):
    from ced_cli.main import main

    base = ["logits", str(GOLDEN_TINY_A), "--prompt-ids", "x.json", "--out", "y.safetensors"]
    assert main([*base, "--num-processes", "2"]) == 2
    assert "need --coordinator" in capsys.readouterr().err
    assert main([*base, "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"]) == 2
    assert "--process-id must be in [0, 2)" in capsys.readouterr().err
