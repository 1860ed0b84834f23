"""The weights digest (`ced_jax.checkpoint.digest`) that keys the KV disk tier: every byte of every
file counts, the per-file hashes are cached by size and mtime, and a load from a directory hashes
that directory's files."""

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

import ced_jax
from ced_jax.checkpoint import digest
from tests.conftest import REPO

TINY_A = REPO / "tests" / "golden" / "tiny-a"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def checkpoint(tmp_path):
    out = tmp_path / "tiny-a"
    shutil.copytree(TINY_A, out, ignore=shutil.ignore_patterns(".*"))
    return out


def scale_bf16_tensors(directory, names, factor):
    """Scales bf16 tensors in place in their safetensors files (same size; returns the files changed)."""
    changed = set()
    for path in sorted(directory.glob("model-*.safetensors")):
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        for name in names:
            if name in header:
                assert header[name]["dtype"] == "BF16"
                begin, end = (8 + n + o for o in header[name]["data_offsets"])
                values = np.frombuffer(bytes(data[begin:end]), ml_dtypes.bfloat16).astype(np.float32)
                data[begin:end] = (values * factor).astype(ml_dtypes.bfloat16).tobytes()
                changed.add(path)
        if path in changed:
            path.write_bytes(bytes(data))
    return changed


def test_a_changed_norm_changes_the_digest_and_only_changed_files_are_hashed_again(checkpoint, monkeypatch):
    first = digest.directory_digest(checkpoint)
    assert (checkpoint / digest.DIGEST_CACHE_NAME).is_file()
    assert digest.directory_digest(checkpoint) == first
    hashed = []
    real = digest.file_sha256
    monkeypatch.setattr(digest, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    assert digest.directory_digest(checkpoint) == first and hashed == []  # all from the cache
    names = [f"layers.{layer}.attn.kv_norm.weight" for layer in (0, 1)]
    shards = scale_bf16_tensors(checkpoint, names, 1.5)  # same sizes: the mtimes tell the change
    changed = digest.directory_digest(checkpoint)
    assert changed != first and sorted(hashed) == sorted(p.name for p in shards)
    (checkpoint / ".cache").mkdir()
    (checkpoint / ".cache" / "hub.lock").write_text("x")  # hidden entries are not weights
    assert digest.directory_digest(checkpoint) == changed


def test_one_flipped_byte_anywhere_changes_the_digest(checkpoint):
    first = digest.directory_digest(checkpoint)
    shard = sorted(checkpoint.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(1, 1))
    assert digest.directory_digest(checkpoint) != first


def test_a_read_only_directory_caches_under_the_user_cache(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    os.chmod(checkpoint, 0o555)
    try:
        if os.access(checkpoint, os.W_OK):  # root ignores the mode: a directory it cannot write is a file
            monkeypatch.setattr(digest, "DIGEST_CACHE_NAME", "config.json/not-a-dir")
        first = digest.directory_digest(checkpoint)
        cached = list((tmp_path / "user-cache" / "ced-jax" / "weights").glob("*.json"))
        assert len(cached) == 1
        assert digest.directory_digest(checkpoint) == first
    finally:
        os.chmod(checkpoint, 0o755)


def test_arrays_digest_sees_names_dtypes_and_bytes():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    base = digest.arrays_digest([("w", a)])
    assert digest.arrays_digest([("w", a.copy())]) == base
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], 10)
    assert digest.arrays_digest([("w", b)]) != base
    assert digest.arrays_digest([("v", a)]) != base
    assert digest.arrays_digest([("w", a.astype(np.float64))]) != base


def test_a_directory_load_digests_its_files(checkpoint):
    model = ced_jax.load(checkpoint)
    assert model.weights_source == checkpoint
    assert model.weights_digest() == digest.directory_digest(checkpoint)
