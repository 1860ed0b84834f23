"""The model with impl="pallas:interpret" (the Pallas kernels in the HLO interpreter, CPU).

Default suite (cheap): the `ced_jax.ops` bridge against impl="reference" on model-shaped inputs,
and a one-layer cut of the tiny preset whose prefill through the kernels equals the reference
path. Slow: PARITY.md mode A on tiny-a with impl="pallas:interpret", bars unchanged (both
index_k_modes; interpret-mode compiles take about 5 minutes per mode on 2 cores).

Tolerance of the cheap checks: kernels form every product exactly (bf16-exact operands, f32
accumulation) and only their f32 summation order is their own, so outputs may differ by one bf16
ulp of an intermediate; logits within 1e-4 of their scale, decisions (top-k rows, expert ids)
equal. A spy checks that the kernels really ran, so the comparison cannot pass vacuously.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import pallas_kernels.grouped_matmul as gmm_module
import pallas_kernels.sparse_attention as attention_module
from ced_jax import ops
from ced_jax.api import Model, load
from ced_jax.config import preset
from ced_jax.quant import fp8_fake_quant
from ced_jax.testing.random_weights import random_params
from pallas_kernels import formats
from tests.ced_jax.test_parity import MODES, assert_mode_a_gate, mode_a_metrics
from tests.conftest import GOLDEN_TINY_A

PALLAS = "pallas:interpret"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel entry points the bridge reaches (traced calls)."""
    calls = {"gmm": 0, "decode": 0, "prefill": 0}

    def spy(module, attr, key):
        real = getattr(module, attr)

        def wrapped(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, attr, wrapped)

    spy(gmm_module, "gmm", "gmm")
    spy(attention_module, "sparse_attention_decode", "decode")
    spy(attention_module, "sparse_attention_prefill", "prefill")
    return calls


# ----------------------------------------------------------------------------- ops bridge
def test_parse_impl():
    assert ops.parse_impl("reference") == ("reference", None, False)
    assert ops.parse_impl("pallas") == ("pallas", None, False)
    assert ops.parse_impl("pallas:interpret") == ("pallas", None, True)
    assert ops.parse_impl("pallas:gpu:interpret") == ("pallas", "gpu", True)
    for bad in ("xla", "pallas:cuda", "pallas:tpu:gpu", "reference:interpret", "pallas:interpret:interpret"):
        with pytest.raises(NotImplementedError, match="not available"):
            ops.parse_impl(bad)


def _expert_case(seed, m, k, n, e):
    rng = np.random.default_rng(seed)
    rows = np.asarray(fp8_fake_quant(jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))))
    w = rng.standard_normal((e, n, k)).astype(np.float32)
    packed, scale = formats.pack_fp4_weight(jnp.asarray(w))
    ids = rng.integers(0, e - 1, m).astype(np.int32)  # expert e-1 stays empty
    return jnp.asarray(rows), jnp.asarray(ids), {"weight": packed, "scale": scale}


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("m", [3, 40], ids=["decode", "prefill"])
def test_expert_matmul_bridge_matches_reference(kernel_calls, backend, m):
    rows, ids, w = _expert_case(m, m, 256, 128, 8)
    ref = np.asarray(jax.jit(lambda r, i, w: ops.expert_matmul(r, i, w))(rows, ids, w))
    impl = f"pallas:{backend}:interpret"
    out = np.asarray(jax.jit(lambda r, i, w: ops.expert_matmul(r, i, w, impl=impl))(rows, ids, w))
    assert kernel_calls["gmm"] == 1
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


def _attention_segments(seed, b, t, h, d, window, x):
    """Model-shaped segments: FP8-quantised window keys ('shared') and FP4 main entries gathered per
    query ('per_query'), random validity, the first query of sequence 0 with no valid key."""
    rng = np.random.default_rng(seed)
    q = formats.round_bf16(jnp.asarray(rng.standard_normal((b, t, h, d)).astype(np.float32)))
    win = fp8_fake_quant(jnp.asarray(rng.standard_normal((b, window, d)).astype(np.float32)), 32)
    main = formats.unpack_fp4_entries(
        formats.quantize_fp4_entries(jnp.asarray(rng.standard_normal((b, t, x, d)).astype(np.float32)))
    )
    win_valid = rng.random((b, t, window)) < 0.7
    main_valid = rng.random((b, t, x)) < 0.6
    win_valid[0, 0] = main_valid[0, 0] = False
    segments = [(win, jnp.asarray(win_valid), "shared"), (main, jnp.asarray(main_valid), "per_query")]
    sink = jnp.asarray(rng.standard_normal(h).astype(np.float32))
    return q, segments, sink


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("t", [1, 5], ids=["decode", "prefill"])
def test_sparse_attention_bridge_matches_reference(kernel_calls, backend, t):
    q, segments, sink = _attention_segments(t, 2, t, 4, 128, 16, 16)
    layouts = [layout for _, _, layout in segments]
    arrays = [(keys, valid) for keys, valid, _ in segments]

    def run(impl):
        def fn(q, arrays, sink):
            segs = [(k, v, lay) for (k, v), lay in zip(arrays, layouts, strict=True)]
            return ops.sparse_attention(q, segs, sink, 128**-0.5, impl=impl)

        return np.asarray(jax.jit(fn)(q, arrays, sink))

    ref = run("reference")
    out = run(f"pallas:{backend}:interpret")
    assert kernel_calls["decode" if t == 1 else "prefill"] == 1
    assert np.isfinite(out).all() and not out[0, 0].any()  # no valid key: zeros
    # Same products, f32 sums in another order: at most one bf16 ulp apart after the rounding.
    np.testing.assert_allclose(out, ref, rtol=2**-7, atol=1e-6)
    assert np.mean(out == ref) > 0.98


def test_sparse_attention_bridge_is_loud_on_unquantised_keys():
    """Keys the packed formats cannot hold exactly come out NaN, not silently rounded."""
    q, segments, sink = _attention_segments(7, 1, 3, 4, 128, 16, 16)
    (win, valid, layout), main = segments
    raw = win + 1e-3  # off the FP8 grid
    out = ops.sparse_attention(q, [(raw, jnp.ones_like(valid), layout), main], sink, 0.1, impl=PALLAS)
    assert np.isnan(np.asarray(out)).any()


# ------------------------------------------------------------------- one-layer model cut
def _one_layer_tiny():
    cfg = dataclasses.replace(
        preset("tiny"),
        num_layers=1,
        compress_ratios=(2,),
        kv_source_layer_ids=(0,),
        index_source_layer_ids=(0,),
        candidate_source_layer_id=-1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
    )
    return cfg, random_params(cfg, 0)


def test_one_layer_prefill_pallas_equals_reference(kernel_calls):
    """A ratio-2 layer (window FP8 + compressed FP4 segments, indexer, MoE) of the tiny preset:
    prefill logits and decisions of impl=pallas:interpret against impl=reference."""
    cfg, flat = _one_layer_tiny()
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 12)
    out = {}
    for impl in ("reference", PALLAS):
        model = Model(cfg, flat, hasher=None, tokenizer_path=None, impl=impl)
        out[impl] = model.logits(prompt, capture=True)
    assert kernel_calls["gmm"] == 3 and kernel_calls["prefill"] == 1
    ref, got = out["reference"], out[PALLAS]
    logits = ref["prefill_logits_full"]
    np.testing.assert_allclose(got["prefill_logits_full"], logits, rtol=0, atol=1e-4 * np.abs(logits).max())
    for key in ("prefill_topk_layer0", "prefill_gate_indices"):
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


# --------------------------------------------------------------------- mode A, full depth
@pytest.fixture(scope="module")
def golden():
    return load_file(str(GOLDEN_TINY_A / "expected.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mode_a_pallas_interpret(golden, mode):
    """PARITY.md mode A on tiny-a, impl=pallas:interpret; the bars of test_parity, unchanged."""
    m = mode_a_metrics(load(str(GOLDEN_TINY_A), impl=PALLAS), golden, mode)
    print(mode, m)
    assert_mode_a_gate(m)
