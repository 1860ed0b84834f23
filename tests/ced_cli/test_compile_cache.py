"""The persistent compilation cache across processes: `generate` from a cache whose every entry was
corrupted, truncated or swapped gives the same tokens (each bad entry compiled again with one
warning), and `ced-jax compile` fills the cache so that `serve` with the same flags compiles nothing.

Each run is a real `ced-jax` subprocess on its own cache directory (not the test run's), over a
one-layer cut of the tiny preset written as a released-format checkpoint, so that the cold compiles
these tests need stay short.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ced_jax.config import ASSETS, preset
from conversion.synthetic import write_synthetic_checkpoint
from tests.conftest import REPO

WARNING = "compiling it again"


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> Path:
    cfg = dataclasses.replace(
        preset("tiny"),
        num_layers=1,
        compress_ratios=(4,),
        kv_source_layer_ids=(0,),
        index_source_layer_ids=(0,),
        candidate_source_layer_id=-1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
        num_nextn_predict_layers=0,
    )
    out = tmp_path_factory.mktemp("one-layer")
    write_synthetic_checkpoint(cfg, out, seed=3, tokenizer_files=[ASSETS / "tiny" / "tokenizer.json"])
    return out


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def _ced(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ced_cli.main", *args]
    return subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _generate(model: Path, cache: Path) -> subprocess.CompletedProcess:
    return _ced(
        "generate", str(model), "--prompt", "hello world", "--max-tokens", "6", "--json",
        "--compilation-cache-dir", str(cache),
    )  # fmt: skip


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))


def test_generate_recompiles_corrupt_truncated_and_foreign_entries(one_layer, tmp_path):
    cache = tmp_path / "xla"
    cold = _generate(one_layer, cache)
    assert cold.returncode == 0, cold.stderr
    assert WARNING not in cold.stderr
    tokens = json.loads(cold.stdout)["token_ids"]
    entries = _entries(cache)
    assert len(entries) >= 3, entries
    # Every entry damaged, three ways in turn: a flipped byte in the middle, cut in half, and another
    # entry's whole (well-formed) file under this one's name.
    blobs = {p: p.read_bytes() for p in entries}
    for i, path in enumerate(entries):
        blob = bytearray(blobs[path])
        if i % 3 == 0:
            blob[len(blob) // 2] ^= 0x40
        elif i % 3 == 1:
            blob = blob[: len(blob) // 2]
        else:
            blob = bytearray(blobs[entries[(i + 1) % len(entries)]])
        path.write_bytes(bytes(blob))
    damaged = _generate(one_layer, cache)
    assert damaged.returncode == 0, damaged.stderr
    assert "Traceback" not in damaged.stderr
    assert json.loads(damaged.stdout)["token_ids"] == tokens
    warned = [line for line in damaged.stderr.splitlines() if WARNING in line]
    named = {re.search(r"entry (\S+) in", line).group(1) for line in warned}
    assert named == {p.name.removesuffix("-cache") for p in entries}  # every one, once each
    assert len(warned) == len(entries)
    # The damaged entries were replaced by good ones: a third run reads them all without a warning.
    again = _generate(one_layer, cache)
    assert again.returncode == 0 and WARNING not in again.stderr, again.stderr
    assert json.loads(again.stdout)["token_ids"] == tokens


def test_no_compilation_cache_writes_nothing(one_layer, tmp_path):
    cache = tmp_path / "unused"
    run = _ced(
        "generate", str(one_layer), "--prompt", "hi", "--max-tokens", "2", "--no-compilation-cache",
        "--compilation-cache-dir", str(cache),
    )  # fmt: skip
    assert run.returncode == 2 and "turned off" in run.stderr
    assert not cache.exists()


SERVE_FLAGS = ["--max-slots", "2", "--page-size", "16", "--max-context", "64", "--prefill-chunk", "16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compile_then_serve_compiles_nothing(one_layer, tmp_path):
    cache = tmp_path / "xla"
    built = _ced("compile", str(one_layer), *SERVE_FLAGS, "--compilation-cache-dir", str(cache))
    assert built.returncode == 0, built.stderr
    summary = re.search(r"(\d+) program calls, (\d+) executables compiled and (\d+) loaded", built.stdout)
    assert summary is not None, built.stdout
    assert int(summary.group(2)) > 0 and int(summary.group(3)) == 0  # a cold cache: all compiled
    assert re.search(r"decode rows=\d+ pages=\d+", built.stdout) and "prefill rows=" in built.stdout
    assert f"cache {cache}: {len(_entries(cache))} entries" in built.stdout
    port = _free_port()
    cmd = [
        sys.executable, "-m", "ced_cli.main", "serve", str(one_layer), *SERVE_FLAGS, "--port", str(port),
        "--metrics-port", "-1", "--http-port", "-1", "--compilation-cache-dir", str(cache),
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while "ced-jax serving" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        started = re.search(r"(\d+) executables compiled in [\d.]+ s, (\d+) loaded", log.read_text())
        assert started is not None, log.read_text()
        assert int(started.group(1)) == 0, log.read_text()  # the counter: nothing compiled
        assert int(started.group(2)) >= int(summary.group(2)), log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()
