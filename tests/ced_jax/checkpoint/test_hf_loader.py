"""Loading the golden tiny-a checkpoint, and every failure mode on corrupted copies of it.

Expected values are computed here from the raw file bytes (own header parser, own e4m3 decoder),
not with the loader's helpers."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ced_jax.checkpoint.hf_loader import CheckpointError, content_sha256, load_hf_checkpoint
from ced_jax.checkpoint.mapping import our_param_specs
from ced_jax.config import ModelConfig, preset
from tests.conftest import GOLDEN_TINY_A

SHARD1, SHARD2, SHARD3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
INDEX = "model.safetensors.index.json"
NP_OF = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I8": np.int8,
         "BF16": ml_dtypes.bfloat16, "F32": np.float32}


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes), straight from the safetensors layout."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def rewrite_shard(path: Path, change) -> None:
    """Re-save a shard with `change(dict name -> array)` applied."""
    arrays = {k: np.frombuffer(b, NP_OF[d]).reshape(s) for k, (d, s, b) in raw_tensors(path).items()}
    change(arrays)
    save_file(arrays, str(path), metadata={"format": "pt"})


def e4m3_to_float(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    sign = np.where(c >> 7, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where((e == 15) & (m == 7), np.nan, sign * mag)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_pretrained(GOLDEN_TINY_A)


@pytest.fixture(scope="module")
def loaded(cfg):
    return load_hf_checkpoint(GOLDEN_TINY_A, cfg)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    out = tmp_path / "tiny-a"
    out.mkdir()
    for name in (SHARD1, SHARD2, SHARD3, INDEX, "config.json"):
        shutil.copyfile(GOLDEN_TINY_A / name, out / name)
    return out


def edit_index(ckpt: Path, change) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    change(index["weight_map"])
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------------- the good path
def test_loads_with_expected_tree(cfg, loaded):
    params, report = loaded
    specs = our_param_specs(cfg)
    assert set(params) == set(specs)
    for path, (shape, dtype) in specs.items():
        assert params[path].shape == shape and params[path].dtype == dtype, path
    assert report.config_checked and report.tensors_read == 657 and report.bytes_read == 12_201_956
    assert sorted(report.consumed) == sorted(f"layers.{i}.attn.wo_a.scale" for i in range(8))
    assert report.skipped == [] and report.notes == []


def test_bytes_are_unchanged(loaded):
    params, _ = loaded
    s1, s3 = raw_tensors(GOLDEN_TINY_A / SHARD1), raw_tensors(GOLDEN_TINY_A / SHARD3)
    for e in (0, 5, 7):
        for part in ("weight", "scale"):
            _, _, b = s1[f"layers.3.ffn.experts.{e}.w2.{part}"]
            assert params[f"layers.3.ffn.experts.w2.{part}"][e].tobytes() == b
    for name in ("layers.2.engram.embed.weight", "layers.2.engram.embed.scale"):
        assert params[name].tobytes() == s3[name][2]
    for name in ("layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "embed.weight",
                 "layers.0.hc_ffn_fn"):
        assert params[name].tobytes() == s1[name][2], name


def test_wo_a_dequantisation(loaded):
    params, _ = loaded
    s1 = raw_tensors(GOLDEN_TINY_A / SHARD1)
    for layer in (0, 2):
        _, shape, wb = s1[f"layers.{layer}.attn.wo_a.weight"]
        _, sshape, sb = s1[f"layers.{layer}.attn.wo_a.scale"]
        w = e4m3_to_float(np.frombuffer(wb, np.uint8)).reshape(shape)
        e = np.frombuffer(sb, np.uint8).reshape(sshape).astype(np.float64)
        expected = w * np.kron(2.0 ** (e - 127), np.ones((32, 32)))
        got = params[f"layers.{layer}.attn.wo_a.weight"]
        assert got.dtype == ml_dtypes.bfloat16
        # e4m3 values times powers of two are exact in bf16.
        np.testing.assert_array_equal(got.astype(np.float64), expected)
        assert np.count_nonzero(expected) > 0.9 * expected.size


def test_include_backbone_only_and_unimplemented_groups(cfg):
    params, report = load_hf_checkpoint(GOLDEN_TINY_A, cfg, include=("backbone",))
    assert "layers.1.engram.embed.weight" not in params and "layers.1.engram.wkv.weight" in params
    assert sorted(n for n, _ in report.skipped) == sorted(
        f"layers.{i}.engram.embed.{p}" for i in (1, 2) for p in ("weight", "scale"))
    with pytest.raises(NotImplementedError, match="vision"):
        load_hf_checkpoint(GOLDEN_TINY_A, cfg, include=("text", "vision"))


def test_optional_groups_are_recognised_and_skipped(ckpt, cfg):
    extra = "model-extra.safetensors"
    save_file({"mtp.0.attn.wq_a.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn),
               "vision.norm.weight": np.ones(8, ml_dtypes.bfloat16)}, str(ckpt / extra))
    edit_index(ckpt, lambda wm: wm.update({"mtp.0.attn.wq_a.weight": extra, "vision.norm.weight": extra}))
    params, report = load_hf_checkpoint(ckpt, cfg)
    notes = dict(report.skipped)
    assert set(notes) == {"mtp.0.attn.wq_a.weight", "vision.norm.weight"}
    assert "DSpark" in notes["mtp.0.attn.wq_a.weight"] and "vision" in notes["vision.norm.weight"]
    assert len(params) == len(our_param_specs(cfg))


def test_content_hash_is_over_sorted_raw_bytes(ckpt):
    import hashlib

    index = json.loads((ckpt / INDEX).read_text())["weight_map"]
    raws = {}
    for f in (SHARD1, SHARD2, SHARD3):
        raws.update({k: v[2] for k, v in raw_tensors(ckpt / f).items()})
    h = hashlib.sha256()
    for name in sorted(index):
        h.update(raws[name])
    assert content_sha256(ckpt) == h.hexdigest()


# ---------------------------------------------------------------------- failures
def load_error(ckpt: Path, cfg: ModelConfig) -> str:
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(ckpt, cfg)
    return str(info.value)


def test_missing_index(ckpt, cfg):
    (ckpt / INDEX).unlink()
    assert INDEX in load_error(ckpt, cfg)


def test_missing_shard_file(ckpt, cfg):
    (ckpt / SHARD2).unlink()
    msg = load_error(ckpt, cfg)
    assert SHARD2 in msg and "missing" in msg


def test_tensor_in_index_absent_from_shard(ckpt, cfg):
    edit_index(ckpt, lambda wm: wm.update({"layers.1.engram.embed.scale": SHARD1}))
    msg = load_error(ckpt, cfg)
    assert "layers.1.engram.embed.scale" in msg and SHARD1 in msg and "absent" in msg


def test_missing_tensor(ckpt, cfg):
    edit_index(ckpt, lambda wm: wm.pop("layers.5.ffn.experts.3.w3.scale"))
    msg = load_error(ckpt, cfg)
    assert "missing" in msg and "layers.5.ffn.experts.3.w3.scale" in msg and "F8_E8M0 [128, 8]" in msg


def test_unknown_tensor(ckpt, cfg):
    edit_index(ckpt, lambda wm: wm.update({"layers.0.attn.wq_c.weight": SHARD1}))
    msg = load_error(ckpt, cfg)
    assert "unknown" in msg and "layers.0.attn.wq_c.weight" in msg and SHARD1 in msg


def test_wrong_shape(ckpt, cfg):
    def change(arrays):
        arrays["layers.2.engram.embed.scale"] = np.zeros((13416, 3), ml_dtypes.float8_e8m0fnu)

    rewrite_shard(ckpt / SHARD3, change)
    msg = load_error(ckpt, cfg)
    assert "layers.2.engram.embed.scale" in msg and SHARD3 in msg
    assert "expected [13416, 2], got [13416, 3]" in msg


def test_wrong_dtype(ckpt, cfg):
    def change(arrays):
        arrays["layers.0.attn.attn_sink"] = arrays["layers.0.attn.attn_sink"].astype(ml_dtypes.bfloat16)

    rewrite_shard(ckpt / SHARD1, change)
    msg = load_error(ckpt, cfg)
    assert "layers.0.attn.attn_sink" in msg and SHARD1 in msg and "expected F32, got BF16" in msg


def test_truncated_shard(ckpt, cfg):
    path = ckpt / SHARD2
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    msg = load_error(ckpt, cfg)
    assert SHARD2 in msg and "truncated" in msg


def test_config_mismatch(ckpt, cfg):
    # A config that differs only where the tensor shapes do not show it.
    msg = load_error(ckpt, cfg.replace(index_topk=32))
    assert "config mismatch" in msg and "index_topk: expected 32, config.json has 16" in msg
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["sliding_window"] = 16
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert "sliding_window: expected 8, config.json has 16" in load_error(ckpt, cfg)


def test_wrong_config_for_checkpoint(ckpt):
    # Without config.json the inventory still catches a different model.
    (ckpt / "config.json").unlink()
    msg = load_error(ckpt, preset("tiny").replace(moe_intermediate_size=64))
    assert "wrong shape" in msg
