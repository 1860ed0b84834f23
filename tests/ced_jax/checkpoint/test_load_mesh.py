"""Loading straight onto a mesh (issue 12.2): `ced_jax.load(path, mesh=...)` for an HF directory
(`ced_jax.checkpoint.mesh_loader`: each device block read from its byte ranges) and for its Orbax
conversion (restore into the target shardings), against the host path (mesh=None).

- On the suite's 8 devices (tiny-a, expert=4 x tensor=2): every parameter has its target sharding and
  the bytes of the host path, for both sources; the HF reader reads each block's byte ranges only
  (bytes read per tensor counted).
- In fresh processes with 8 fake CPU devices (bench/load_mesh.py `child`), a 188 MB released-format
  checkpoint (random bytes in the released layout, mid with 16 experts) and its conversion: the host
  transient (peak RSS - baseline - device buffers - host Engram tables, see the bench's docstring)
  stays within the largest parameter + a slack far below the model size, the shardings are the
  targets, and the previous path (whole checkpoint in host numpy, then placed) breaks the HF bound,
  so the measurement can fail.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import ced_jax
from ced_jax import sharding
from ced_jax.checkpoint.hf_loader import load_hf_checkpoint
from ced_jax.checkpoint.mesh_loader import load_hf_onto_mesh
from ced_jax.checkpoint.place import mesh_targets
from ced_jax.config import ModelConfig
from conversion.convert import ConvertOptions, convert
from tests.conftest import GOLDEN_TINY_A, REPO

MIB = 1 << 20
MESH = {"expert": 4, "tensor": 2}
# Slack over the largest parameter for the host transient. HF: the interpreter's own churn (measured
# 7-9 MiB with a 16 MiB largest parameter); the whole-checkpoint-first path measured 81 MiB.
# Converted: Orbax keeps up to (largest leaf + converted.READ_SLACK_BYTES) in flight, plus what
# TensorStore keeps after its first restore (measured transient 78 MiB in all); restoring every leaf
# at once, as Orbax does without a read budget, measured 217 MiB (the whole model is 185 MiB).
HF_SLACK = 32 * MIB
CONVERTED_SLACK = 96 * MIB


def _bench():
    spec = importlib.util.spec_from_file_location("bench_load_mesh", REPO / "bench" / "load_mesh.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _leaves(params) -> dict[str, object]:
    return {
        ".".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


@pytest.fixture(scope="module")
def tiny_converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-conv") / "conv"
    convert(GOLDEN_TINY_A, out, ConvertOptions(progress=False))
    return out


def test_tiny_a_on_mesh_matches_host_path(tiny_converted):
    mesh = sharding.make_mesh(MESH)
    host = _leaves(
        ced_jax.load(GOLDEN_TINY_A, weight_layout="stored").params
    )  # a mesh holds the stored leaves
    for source in (GOLDEN_TINY_A, tiny_converted):
        model = ced_jax.load(source, mesh=mesh)
        targets = mesh_targets(model.cfg, mesh, model.rules)
        got = _leaves(model.params)
        assert sorted(got) == sorted(host)
        assert {n for n, t in targets.items() if t.spec != jax.P()}, "nothing is sharded: a vacuous test"
        for name, leaf in got.items():
            assert leaf.sharding.is_equivalent_to(targets[name], leaf.ndim), (source, name, leaf.sharding)
            ref = np.asarray(host[name])
            arr = np.asarray(leaf)
            assert (arr.dtype, arr.shape) == (ref.dtype, ref.shape), (source, name)
            assert arr.tobytes() == ref.tobytes(), (source, name)


def test_blocks_read_piecewise_are_the_host_bytes():
    """Blocks split along a later dimension are read in pieces (here of 1000 bytes, so every such
    block takes several); the Engram tables, not in `shardings`, come back as host numpy."""
    cfg = ModelConfig.from_pretrained(GOLDEN_TINY_A)
    mesh = sharding.make_mesh(MESH)
    targets = mesh_targets(cfg, mesh, "ep_tp")
    host, host_report = load_hf_checkpoint(GOLDEN_TINY_A, cfg)
    got, report = load_hf_onto_mesh(GOLDEN_TINY_A, cfg, targets, bf16_as_f32=False, piece_bytes=1000)
    assert sorted(got) == sorted(host)
    assert any(t.spec[0] is None and any(t.spec) for t in targets.values()), "no later-dimension split"
    for name, ref in host.items():
        if name in targets:
            arr = np.asarray(got[name])
            assert got[name].sharding == targets[name], name
        else:
            assert isinstance(got[name], np.ndarray), name
            arr = got[name]
        assert (arr.dtype, arr.shape) == (ref.dtype, ref.shape) and arr.tobytes() == ref.tobytes(), name
    assert report.tensors_read == host_report.tensors_read
    assert report.consumed == sorted(report.consumed) and sorted(report.consumed) == sorted(
        host_report.consumed
    )


def test_bad_sharding_path_is_named():
    cfg = ModelConfig.from_pretrained(GOLDEN_TINY_A)
    mesh = sharding.make_mesh(MESH)
    with pytest.raises(ValueError, match="layers.0.no_such"):
        load_hf_onto_mesh(GOLDEN_TINY_A, cfg, {"layers.0.no_such": sharding.replicated(mesh)})


@pytest.fixture(scope="module")
def mid16(tmp_path_factory):
    bench = _bench()
    root = tmp_path_factory.mktemp("mid16")
    cfg = bench.bench_config(16)
    bench.write_random_checkpoint(cfg, root / "hf", seed=1)
    convert(root / "hf", root / "conv", ConvertOptions(progress=False, compression=False))
    return bench, cfg, root


def _digests(flat: dict[str, np.ndarray]) -> dict[str, str]:
    out = {}
    for name, arr in flat.items():
        if arr.dtype == ml_dtypes.bfloat16:  # the mesh path widens bf16 to f32 on CPU (exact)
            arr = arr.astype(np.float32)
        out[name] = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    return out


@pytest.mark.slow  # ~45-65 s of fresh-process loads; the default suite is at its 30-min budget
def test_peak_host_memory_on_8_fake_devices(mid16):
    bench, cfg, root = mid16
    host, _ = load_hf_checkpoint(root / "hf", cfg)
    expected = _digests(host)
    model_bytes = sum(a.nbytes for a in host.values())
    del host
    mesh = ",".join(f"{k}={v}" for k, v in MESH.items())
    for source, slack in (("hf", HF_SLACK), ("conv", CONVERTED_SLACK)):
        r = bench.run_child(root / source, mesh, timeout=600)
        assert r["devices"] == 8 and r["peak_reset"], r
        assert r["wrong_shardings"] == [], r
        assert r["digests"] == {k: v for k, v in expected.items() if k in r["digests"]}, source
        assert set(expected) - set(r["digests"]) == {n for n in expected if ".engram.embed." in n}, source
        assert slack + r["largest_group"] < model_bytes  # the bound is below the whole model
        assert r["transient"] <= r["largest_group"] + slack, (source, r)
    # The previous path (every tensor in host numpy first) is caught by the same measurement.
    r = bench.run_child(root / "hf", mesh, via_host=True, timeout=600)
    assert r["transient"] > r["largest_group"] + HF_SLACK, r


def test_each_block_reads_only_its_byte_ranges(monkeypatch):
    """Bytes read per HF tensor: a block reads the rows of its leading-dimension range only (so a
    tensor split along its leading dimension, or an expert of a stacked parameter, is read exactly
    once over all blocks), a block split along a later dimension reads its row band once per such
    block, a replicated block once for all devices, `wo_a` once."""
    from ced_jax.checkpoint import mesh_loader
    from ced_jax.checkpoint.mapping import hf_inventory, our_target

    cfg = ModelConfig.from_pretrained(GOLDEN_TINY_A)
    mesh = sharding.make_mesh(MESH)
    targets = mesh_targets(cfg, mesh, "ep_tp")
    read: dict[str, int] = {}
    original = mesh_loader._Files.read_into

    def counting(self, t, start, out):
        read[t.name] = read.get(t.name, 0) + len(out)
        return original(self, t, start, out)

    monkeypatch.setattr(mesh_loader._Files, "read_into", counting)
    _, report = load_hf_onto_mesh(GOLDEN_TINY_A, cfg, targets)
    assert report.bytes_read == sum(read.values())
    sizes = dict(mesh.shape)
    checked = {"leading": 0, "later": 0, "expert": 0}
    for name, spec in hf_inventory(cfg).items():
        if spec.group != "backbone":
            continue
        t = our_target(name)
        axes = tuple(targets[t.path].spec)
        later = axes[2:] if t.kind == "stack" else axes[1:]
        factor = (
            1 if t.kind in ("wo_a", "wo_a_scale") else math.prod(sizes[a] for a in later if a is not None)
        )
        assert read.get(name) == spec.nbytes * factor, (name, axes, read.get(name), spec.nbytes)
        if t.kind == "stack" and axes[0] is not None:
            checked["expert"] += 1
        elif axes and axes[0] is not None:
            checked["leading"] += 1
        elif any(a is not None for a in later):
            checked["later"] += 1
    assert all(checked.values()), checked
