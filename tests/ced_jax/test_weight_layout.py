"""Weight layouts (`ced_jax.checkpoint.weight_layout`): dequantising at load changes where the work happens,
never a value. Every layout gives the stored layout's linears, expert products, logits and tokens
bit for bit (the whole model: slow; the golden parity gates run the CPU default, "f32")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.api import load
from ced_jax.checkpoint.weight_layout import (
    F32_EXPERTS_MAX_BYTES,
    apply_weight_layout,
    default_weight_layout,
    routed_expert_f32_bytes,
)
from ced_jax.config import preset
from ced_jax.model.layers import kernels
from ced_jax.model.layers.common import fp8_linear
from ced_jax.model.layers.moe import routed_experts
from ced_jax.options import REFERENCE, Impl

PROMPT = [0, 17, 23, 99, 4, 250, 31, 8, 77, 140, 5, 61]


def _quantised_leaves(params: dict) -> list[str]:
    """Paths of FP8 / packed-FP4 leaves outside the Engram tables."""
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if ("'embed'" in name and "'engram'" in name) or name.startswith("['mtp']"):
            continue  # the Engram tables and the DSpark stages stay stored
        if leaf.dtype in (jnp.float8_e4m3fn, jnp.uint8):
            found.append(name)
    return found


@pytest.fixture(scope="module")
def models():
    return {layout: load("tiny", weight_layout=layout) for layout in ("stored", "f32-dense", "f32")}


def test_linears_and_experts_match_the_stored_layout_bit_for_bit(models):
    stored, f32 = models["stored"].params["layers"]["2"], models["f32"].params["layers"]["2"]
    dense = models["f32-dense"].params["layers"]["2"]
    rng = np.random.default_rng(0)
    d = stored["attn"]["wq_a"]["weight"].shape[1]
    for rows in (1, 3, 16):  # decode (gather per row) and prefill (expert loop) paths
        x = jnp.asarray(rng.standard_normal((rows, d)).astype(np.float32))
        for name in ("wq_a", "wkv"):
            want = fp8_linear(x, stored["attn"][name])
            assert np.array_equal(np.asarray(want), np.asarray(fp8_linear(x, f32["attn"][name]))), name
            assert np.array_equal(np.asarray(want), np.asarray(fp8_linear(x, dense["attn"][name]))), name
        ids = jnp.asarray(rng.integers(0, 8, (rows, 2)).astype(np.int32))
        weights = jnp.asarray(rng.random((rows, 2)).astype(np.float32))
        want = routed_experts(x, ids, weights, stored["ffn"]["experts"], limit=10.0, impl=REFERENCE)
        got = routed_experts(x, ids, weights, f32["ffn"]["experts"], limit=10.0, impl=REFERENCE)
        assert np.array_equal(np.asarray(want), np.asarray(got)), rows


@pytest.fixture(scope="module")
def runs(models):
    # "f32" dequantises everything "f32-dense" does and the routed experts too, so the whole model is run
    # in the two ends (each layout compiles its own programs: minutes on CPU); the linears and experts of
    # every layout are compared bit for bit above.
    out = {}
    for layout in ("stored", "f32"):
        model = models[layout]
        out[layout] = (model, model.logits(PROMPT), model.generate(PROMPT, 6, stop_at_eos=False))
    return out


@pytest.mark.slow
def test_layouts_give_the_stored_numbers_bit_for_bit(runs):
    _, ref_logits, ref_gen = runs["stored"]
    for layout in ("f32",):
        _, logits, gen = runs[layout]
        for key, value in ref_logits.items():
            if hasattr(value, "dtype"):
                assert np.array_equal(np.asarray(value), np.asarray(logits[key]), equal_nan=True), (
                    layout,
                    key,
                )
        assert gen["token_ids"] == ref_gen["token_ids"], layout


def test_layouts_hold_what_they_say(models):
    stored = _quantised_leaves(models["stored"].params)
    dense = _quantised_leaves(models["f32-dense"].params)
    assert any("'experts'" in name for name in stored)
    assert any("'wq_a'" in name for name in stored)
    # f32-dense: only the routed experts stay quantised; f32: nothing outside the Engram tables.
    assert dense and all("'experts'" in name for name in dense)
    assert _quantised_leaves(models["f32"].params) == []
    assert models["f32"].weight_layout == "f32"
    # A dequantised linear keeps the stored [N, K] shape and drops its scales.
    stored_wq = models["stored"].params["layers"]["0"]["attn"]["wq_a"]
    f32_wq = models["f32"].params["layers"]["0"]["attn"]["wq_a"]
    assert set(f32_wq) == {"weight"} and f32_wq["weight"].shape == stored_wq["weight"].shape


def test_default_layout_follows_backend_mesh_impl_and_size():
    cfg = preset("tiny")
    assert routed_expert_f32_bytes(cfg) <= F32_EXPERTS_MAX_BYTES
    assert default_weight_layout(cfg, backend="cpu", mesh=None, impl="reference") == "f32"
    assert default_weight_layout(cfg, backend="cpu", mesh=None, impl="pallas:interpret") == "stored"
    assert default_weight_layout(cfg, backend="gpu", mesh=None, impl="reference") == "stored"
    assert default_weight_layout(cfg, backend="cpu", mesh=object(), impl="reference") == "stored"
    big = preset("v41-flash")
    assert routed_expert_f32_bytes(big) > F32_EXPERTS_MAX_BYTES
    assert default_weight_layout(big, backend="cpu", mesh=None, impl="reference") == "stored"


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="weight_layout: expected one of"):
        load("tiny", weight_layout="bf16")
    with pytest.raises(ValueError, match="impl='pallas'"):
        load("tiny", impl="pallas:interpret", weight_layout="f32")
    with pytest.raises(ValueError, match="a mesh places the stored formats"):
        load("tiny", mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), weight_layout="f32")
    with pytest.raises(ValueError, match="weight_layout: expected one of"):
        apply_weight_layout({}, "fp8", block=32)


def test_pallas_grouped_matmul_refuses_dequantised_experts(models):
    experts = models["f32"].params["layers"]["0"]["ffn"]["experts"]["w1"]
    rows = jnp.zeros((4, experts["weight"].shape[-1]), jnp.float32)
    with pytest.raises(ValueError, match="reads packed experts"):
        kernels.expert_matmul(rows, jnp.zeros((4,), jnp.int32), experts, impl=Impl.parse("pallas:interpret"))
