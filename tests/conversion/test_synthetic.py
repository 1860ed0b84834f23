"""The synthetic generator against the mid README's recipe, checked by independent properties
(own e4m3 / e2m1 / bf16 rounding, scale minimality, draw recipe) rather than by our own outputs.
The full-checkpoint content hash published in the README is the `slow` test at the end."""

from __future__ import annotations

import hashlib
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from ced_jax.checkpoint.hf_loader import content_sha256, load_hf_checkpoint
from ced_jax.checkpoint.mapping import hf_inventory
from ced_jax.config import ModelConfig, preset
from ced_jax.testing.random_weights import (
    draw,
    generate,
    iter_hf_tensors,
    quantize_fp8,
    random_params,
)
from conversion.synthetic import default_shard_plan, write_synthetic_checkpoint
from pallas_kernels.formats import np_e2m1_codes as e2m1_codes
from tests.conftest import GOLDEN_TINY_A, REPO

MID = REPO / "bench" / "configs" / "mid"
MID_CONTENT_SHA256 = "01e2d4e53a4ccded6dfe6c551f70881fc9740dc126d3340145f0ef8ee955ac03"  # README
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


@pytest.fixture(scope="module")
def mid() -> ModelConfig:
    return ModelConfig.from_pretrained(MID)


@pytest.fixture(scope="module")
def mid_inv(mid) -> dict:
    return hf_inventory(mid)


def readme_rng(name: str, seed: int = 3000) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def e4m3_grid() -> np.ndarray:
    """The non-negative finite e4m3fn values by code 0..126, decoded from the bit layout."""
    c = np.arange(127)
    e, m = c >> 3, c & 7
    return np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))


def nearest_code(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value (grid ascending, index = code), ties to the even code."""
    hi = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    return np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))


# ---------------------------------------------------------------------- draws
def test_draw_recipe(mid_inv):
    spec = mid_inv["layers.0.attn.wq_a.weight"]
    expected = readme_rng(spec.name).standard_normal((256, 1024), dtype=np.float32)
    expected *= np.float32(1 / np.sqrt(1024))
    np.testing.assert_array_equal(draw(spec, 3000), expected)

    norm = readme_rng("layers.3.attn.q_norm.weight").standard_normal(256, dtype=np.float32)
    norm = norm * np.float32(0.1) + np.float32(1.0)
    np.testing.assert_array_equal(draw(mid_inv["layers.3.attn.q_norm.weight"], 3000), norm)

    scale = readme_rng("layers.5.hc_ffn_scale").random(3, dtype=np.float32)
    scale = scale * np.float32(1.0) + np.float32(0.5)
    np.testing.assert_array_equal(draw(mid_inv["layers.5.hc_ffn_scale"], 3000), scale)

    base = readme_rng("layers.2.hc_attn_base").standard_normal(24, dtype=np.float32) * np.float32(0.5)
    diff = draw(mid_inv["layers.2.hc_attn_base"], 3000) - base
    assert np.flatnonzero(diff).tolist() == [8, 13, 18, 23]  # 2*hc + i*hc + i
    np.testing.assert_allclose(diff[[8, 13, 18, 23]], 1.0, atol=1e-6)


def test_stds_per_kind(mid_inv):
    # Spot-check the README's std table on the draws themselves.
    for name, std in [("layers.0.attn.wo_a.weight", 1 / np.sqrt(512)), ("head.weight", 2 / np.sqrt(1024)),
                      ("layers.0.ffn.gate.weight", 1.5 / np.sqrt(1024)),
                      ("layers.1.ffn.experts.7.w2.weight", 0.25 / np.sqrt(512)),
                      ("layers.1.engram.wkv.weight", 1 / np.sqrt(768))]:
        assert np.float32(mid_inv[name].init.std) == np.float32(std), name
        assert draw(mid_inv[name], 3000).std() == pytest.approx(std, rel=0.02), name


# ---------------------------------------------------------------------- FP8
def check_fp8(w: np.ndarray, q: np.ndarray, byte: np.ndarray, br: int, bc: int) -> None:
    scale = 2.0 ** (byte.astype(np.float64) - 127)
    full = np.kron(scale, np.ones((br, bc)))[: w.shape[0], : w.shape[1]]
    # Scales: the smallest power of two with amax / scale <= 448 (amax floored at 2^-100).
    amax = np.maximum(np.abs(w.astype(np.float64)).reshape(-1, br, w.shape[1] // bc, bc).max(axis=(1, 3)),
                      2.0**-100)
    assert np.all(amax / scale <= 448) and np.all(amax / (scale / 2) > 448)
    v = np.clip(w / full, -448, 448)
    code = nearest_code(np.abs(v), e4m3_grid()) | (np.signbit(v).astype(np.int64) << 7)
    np.testing.assert_array_equal(q.view(np.uint8), code.astype(np.uint8))


def test_fp8_blocks_on_e4m3_grid(mid_inv):
    for name in ("layers.0.attn.wo_a.weight", "layers.4.attn.indexer.wq_b.weight"):
        spec = mid_inv[name]
        out = generate(spec, 3000, 32)
        q, byte = out[name], out[name.replace(".weight", ".scale")]
        assert q.dtype == ml_dtypes.float8_e4m3fn
        assert byte.shape == mid_inv[name.replace("weight", "scale")].shape
        check_fp8(draw(spec, 3000), q, byte, 32, 32)


def test_fp8_engram_rows(mid_inv):
    spec = mid_inv["layers.1.engram.embed.weight"]
    w = draw(spec, 3000)[:4096]
    q, byte = quantize_fp8(w, 1, 32)
    assert byte.shape == (4096, 2)
    check_fp8(w, q, byte, 1, 32)


def test_fp8_ties_saturation_and_floor():
    grid = e4m3_grid()
    block = np.zeros((32, 32), np.float32)
    block[0, 0] = 448.0  # amax 448 -> scale 2^0 (byte 127)
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)  # exact ties, all representable in f32
    block.flat[1 : 1 + len(mids)] = mids
    block.flat[200:326] = -mids
    block.flat[400] = -1e-30  # rounds to -0
    q, byte = quantize_fp8(block, 32, 32)
    assert byte.tolist() == [[127]]
    check_fp8(block, q, byte, 32, 32)
    assert q.view(np.uint8).flat[400] == 0x80
    # The float32 just above 448 is 448 * (1 + 6.8e-8); amax / 448 then rounds up past 1.0, so the
    # scale doubles. No float32 amax can make |w / scale| exceed 448, so the clamp never acts; it
    # matters only in principle (the cast itself does not saturate: past 464 it gives NaN).
    block[0, 0] = np.nextafter(np.float32(448), np.float32(np.inf))
    q, byte = quantize_fp8(block, 32, 32)
    assert byte.tolist() == [[128]] and float(q[0, 0]) == 224.0
    check_fp8(block, q, byte, 32, 32)
    assert np.isnan(np.float32(470).astype(ml_dtypes.float8_e4m3fn))
    # An all-zero block takes the floor: 2^-100 / 448 -> 2^-108 (byte 19).
    q, byte = quantize_fp8(np.zeros((32, 64), np.float32), 32, 32)
    assert byte.tolist() == [[19, 19]] and not q.view(np.uint8).any()


# ---------------------------------------------------------------------- FP4
def test_e2m1_codes_rounding():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    # README: the midpoints go to 0, 1, 1, 2, 2, 4, 4.
    assert E2M1[e2m1_codes(mids)].tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert e2m1_codes(np.array([-0.1, -0.0, 0.0, -6.0, 6.0], np.float32)).tolist() == [8, 8, 0, 15, 7]
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.uniform(-6, 6, 100_000).astype(np.float32), mids, -mids,
                        E2M1.astype(np.float32), -E2M1.astype(np.float32)])
    # ml_dtypes' float4_e2m1fn is an independent RNE implementation with the same code layout.
    np.testing.assert_array_equal(e2m1_codes(v), v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def test_fp4_expert_packing_and_scales(mid_inv):
    name = "layers.6.ffn.experts.99.w1.weight"
    spec = mid_inv[name]
    out = generate(spec, 3000, 32)
    packed, byte = out[name], out[name.replace("weight", "scale")]
    assert packed.shape == (512, 512) and packed.dtype == np.uint8 and byte.shape == (512, 32)
    w = draw(spec, 3000).astype(np.float64)
    scale = 2.0 ** (byte.astype(np.float64) - 127)
    amax = np.maximum(np.abs(w).reshape(512, 32, 32).max(axis=2), 2.0**-100)
    assert np.all(amax / scale <= 6) and np.all(amax / scale > 3)
    v = np.clip(w / np.repeat(scale, 32, axis=1), -6, 6)
    code = nearest_code(np.abs(v), E2M1) | (np.signbit(v).astype(np.int64) << 3)
    np.testing.assert_array_equal(packed & 0xF, code[:, 0::2])  # even index in the low nibble
    np.testing.assert_array_equal(packed >> 4, code[:, 1::2])


# ---------------------------------------------------------------------- BF16 and reproducibility
def test_bf16_round_to_nearest_even(mid_inv):
    spec = mid_inv["layers.2.attn.compressor.wgate.weight"]
    bits = draw(spec, 3000).view(np.uint32).astype(np.uint64)
    expected = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    got = generate(spec, 3000, 32)[spec.name]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), expected)


def test_order_independent_and_seeded(mid):
    names = ["layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale", "layers.7.ffn.gate.bias"]
    a = dict(iter_hf_tensors(mid, 3000, names))
    b = dict(iter_hf_tensors(mid, 3000, names[::-1]))
    alone = dict(iter_hf_tensors(mid, 3000, ["layers.0.attn.wkv.scale"]))
    other = dict(iter_hf_tensors(mid, 3001, names))
    for n in names:
        assert a[n].tobytes() == b[n].tobytes()
        assert a[n].tobytes() != other[n].tobytes()
    assert alone["layers.0.attn.wkv.scale"].tobytes() == a["layers.0.attn.wkv.scale"].tobytes()


# ---------------------------------------------------------------------- checkpoints
def test_tiny_checkpoint_round_trip(tmp_path):
    cfg = preset("tiny")
    info = write_synthetic_checkpoint(cfg, tmp_path, seed=7)
    inventory = hf_inventory(cfg)
    assert info["tensors"] == len(inventory)
    # Same layout as the golden tiny-a (the release's): identical index, shard by shard, for the
    # model tiny-a also has; tiny's DSpark stages (mtp.*, which tiny-a lacks) go with the second half.
    index = (tmp_path / "model.safetensors.index.json").read_text()
    weight_map = json.loads(index)["weight_map"]
    golden = json.loads((GOLDEN_TINY_A / "model.safetensors.index.json").read_text())
    assert {n: f for n, f in weight_map.items() if not n.startswith("mtp.")} == golden["weight_map"]
    dspark = {n for n, s in inventory.items() if s.group == "dspark"}
    assert dspark and {weight_map[n] for n in dspark} == {weight_map["head.weight"]}
    assert json.loads(index)["metadata"]["total_size"] == sum(s.nbytes for s in inventory.values())
    assert index.endswith("}\n")
    for file in info["files"]:
        with safe_open(str(tmp_path / file), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    params, report = load_hf_checkpoint(tmp_path, cfg, include=("text", "dspark"))
    expected = random_params(cfg, 7)
    assert set(params) == set(expected) and any(k.startswith("mtp.") for k in expected)
    for k, v in expected.items():
        assert params[k].dtype == v.dtype and params[k].tobytes() == v.tobytes(), k
    text_only, report = load_hf_checkpoint(tmp_path, cfg)
    assert set(text_only) == {k for k in expected if not k.startswith("mtp.")}
    assert {n for n, _ in report.skipped} == dspark


def test_custom_shard_plan_splitting_a_pair(tmp_path):
    cfg = preset("tiny")
    plan = default_shard_plan(cfg)
    plan[0].remove("layers.0.attn.wq_a.scale")  # scale apart from its weight
    plan[1].append("layers.0.attn.wq_a.scale")
    write_synthetic_checkpoint(cfg, tmp_path, seed=7, shard_plan=plan)
    params, _ = load_hf_checkpoint(tmp_path, cfg, include=("backbone",))
    expected = dict(iter_hf_tensors(cfg, 7, ["layers.0.attn.wq_a.scale"]))
    assert params["layers.0.attn.wq_a.scale"].tobytes() == expected["layers.0.attn.wq_a.scale"].tobytes()
    with pytest.raises(ValueError, match="partition"):
        write_synthetic_checkpoint(cfg, tmp_path / "bad", seed=7, shard_plan=plan[:2])


@pytest.mark.slow
def test_mid_content_hash_matches_readme(tmp_path, mid):
    info = write_synthetic_checkpoint(mid, tmp_path, seed=3000, config_path=MID / "config.json")
    assert info["total_size"] == 939_003_956 and info["tensors"] == 6417
    assert content_sha256(tmp_path) == MID_CONTENT_SHA256
