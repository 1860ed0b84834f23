"""The model with impl="pallas:interpret" (the Pallas kernels in the HLO interpreter, CPU).

Default suite (cheap): the `ced_jax.model.layers.kernels` bridge (sparse attention, indexer scoring, expert
matmul) against impl="reference" on model-shaped paged inputs, and a one-layer cut of the tiny
preset whose prefill through the kernels equals the reference path. Slow: PARITY.md mode A on
tiny-a with impl="pallas:interpret", bars unchanged (both index_k_modes; interpret-mode compiles
take about 5 minutes per mode on 2 cores).

Tolerance of the cheap checks: kernels form every product exactly (bf16-exact operands, f32
accumulation). The TPU kernels (the default in interpret mode) then take the reference's sums in
the reference's order (`pallas_kernels._tiles`, "the reference's order on XLA:CPU"), so the bridge
checks require their outputs to equal the reference's bit for bit; the GPU kernels sum in their
own order (entry tiles), so theirs may differ by one bf16 ulp of an intermediate. The one-layer
cut feeds the kernels its window as two segments where the reference reads one in position order
(`ced_jax.model.layers.attention`): logits within 1e-4 of their scale, decisions (top-k rows, expert ids)
equal. A spy checks that the kernels really ran, so the comparison cannot pass vacuously; pages
no page table names are poisoned (NaN once decoded) and the tables are shuffled, so both paths
must read the pages through the tables.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import pallas_kernels.grouped_matmul as gmm_module
import pallas_kernels.indexer as indexer_module
import pallas_kernels.sparse_attention as attention_module
from ced_jax.api import Model, load
from ced_jax.config import preset
from ced_jax.model.layers import kernels
from ced_jax.options import Impl
from ced_jax.quant import fp4_fake_quant_e4m3, fp8_fake_quant
from ced_jax.testing.random_weights import random_params
from pallas_kernels import formats
from tests.ced_jax.test_parity import MODES, assert_mode_a_gate, mode_a_metrics
from tests.conftest import GOLDEN_TINY_A
from tests.pallas_kernels.cases import POISON, indexer_case

PALLAS = "pallas:interpret"


@pytest.fixture
def kernel_calls(monkeypatch, fresh_programs):
    """Counts the kernel entry points the bridge reaches (traced calls: the test's models trace their
    own programs, `fresh_programs`)."""
    calls = {"gmm": 0, "decode": 0, "prefill": 0, "index": 0}

    def spy(module, attr, key):
        real = getattr(module, attr)

        def wrapped(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, attr, wrapped)

    spy(gmm_module, "gmm", "gmm")
    spy(attention_module, "sparse_attention_decode", "decode")
    spy(attention_module, "sparse_attention_prefill", "prefill")
    spy(indexer_module, "index_scores", "index")
    return calls


# ----------------------------------------------------------------------------- ops bridge
def test_parse_impl():
    for text, want in (
        ("reference", ("reference", None, False)),
        ("pallas", ("pallas", None, False)),
        ("pallas:interpret", ("pallas", None, True)),
        ("pallas:gpu:interpret", ("pallas", "gpu", True)),
        ("cpu", ("cpu", None, False)),
    ):
        assert Impl.parse(text) == want and str(Impl.parse(text)) == text
    for bad in ("xla", "pallas:cuda", "pallas:tpu:gpu", "reference:interpret", "pallas:interpret:interpret",
                "cpu:interpret", "cpu:gpu"):  # fmt: skip
        with pytest.raises(NotImplementedError, match="not available"):
            Impl.parse(bad)


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
    ref = np.asarray(jax.jit(lambda r, i, w: kernels.expert_matmul(r, i, w))(rows, ids, w))
    impl = Impl("pallas", backend, interpret=True)
    out = np.asarray(jax.jit(lambda r, i, w: kernels.expert_matmul(r, i, w, impl=impl))(rows, ids, w))
    assert kernel_calls["gmm"] == 1
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())
    if backend == "tpu":  # the reference's summation order in interpret mode
        np.testing.assert_array_equal(out, ref)


def _attention_segments(seed, b, t, h, d, window, x):
    """The model's three segments, packed in pages: the window rings (one page of `window` FP8
    entries per slot, the rows on shuffled slots), the chunk's own FP8 keys (one transient page per
    row) and `x` FP4 main entries per query from compressed pages through a shuffled page table.
    Random validity; the first query of sequence 0 has no valid key; unnamed pages are poisoned."""
    rng = np.random.default_rng(seed)
    q = formats.round_bf16(jnp.asarray(rng.standard_normal((b, t, h, d)).astype(np.float32)))
    fp8_pages = lambda shape: np.array(formats.pack_fp8_entries(fp8_fake_quant(_normal(rng, shape), 32)))
    fp4_pages = lambda shape: np.array(formats.pack_fp4_entries(fp4_fake_quant_e4m3(_normal(rng, shape), 16)))

    slots = rng.permutation(b + 2)[:b].astype(np.int32)  # two slots no row uses
    rings = fp8_pages((b + 2, window, d))
    rings[np.setdiff1d(np.arange(b + 2), slots)] = POISON
    chunk = fp8_pages((b, t, d))
    per_page, pages_per_row = 4, -(-2 * x // 4)  # a row holds 2x compressed entries
    num_pages = b * pages_per_row + 2
    compressed = fp4_pages((num_pages, per_page, d))
    table = rng.permutation(num_pages)[: b * pages_per_row].reshape(b, pages_per_row).astype(np.int32)
    compressed[np.setdiff1d(np.arange(num_pages), table)] = POISON

    ring_valid = rng.random((b, t, window)) < 0.7
    chunk_valid = np.tril(np.ones((t, t), bool))[None] & (rng.random((b, t, t)) < 0.8)
    main_ids = rng.integers(0, pages_per_row * per_page, (b, t, x)).astype(np.int32)
    main_valid = rng.random((b, t, x)) < 0.6
    for valid in (ring_valid, chunk_valid, main_valid):
        valid[0, 0] = False
    segments = [
        (rings, slots[:, None], np.tile(np.arange(window), (b, 1)), ring_valid),
        (chunk, np.arange(b)[:, None], np.tile(np.arange(t), (b, 1)), chunk_valid),
        (compressed, table, main_ids, main_valid),
    ]
    segments = [kernels.KeySegment(*(jnp.asarray(a) for a in seg)) for seg in segments]
    sink = jnp.asarray(rng.standard_normal(h).astype(np.float32))
    return q, segments, sink


def _normal(rng, shape):
    """Values over a few binades, as keys are."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-3, 3, shape[:-1] + (1,)))
    return jnp.asarray(x.astype(np.float32))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("t", [1, 5], ids=["decode", "prefill"])
def test_sparse_attention_bridge_matches_reference(kernel_calls, backend, t):
    q, segments, sink = _attention_segments(t, 2, t, 4, 128, 16, 16)

    def run(impl):
        fn = lambda q, segments, sink: kernels.sparse_attention(
            q, segments, sink, 128**-0.5, impl=Impl.parse(impl)
        )
        return np.asarray(jax.jit(fn)(q, segments, sink))

    ref = run("reference")
    out = run(f"pallas:{backend}:interpret")
    assert kernel_calls["decode" if t == 1 else "prefill"] == 1
    assert np.isfinite(ref).all() and not ref[0, 0].any()  # poisoned pages unread; no valid key: zeros
    assert np.isfinite(out).all() and not out[0, 0].any()
    # Same products, f32 sums in another order: at most one bf16 ulp apart after the rounding.
    np.testing.assert_allclose(out, ref, rtol=2**-7, atol=1e-6)
    assert np.mean(out == ref) > 0.98
    if backend == "tpu":  # the reference's summation order in interpret mode
        np.testing.assert_array_equal(out, ref)


# (seed, B, T, I, Dk, keys per page, pages per row): the tiny preset's index keys at page_size 16
# (8 entries of a ratio-2 source per page), a decode step, and pages of 128 keys.
INDEX_CASES = [(3, 2, 12, 8, 128, 8, 4), (4, 3, 1, 8, 128, 8, 4), (5, 2, 5, 8, 128, 128, 2)]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("case", INDEX_CASES, ids=["prefill-p8", "decode-p8", "prefill-p128"])
def test_index_scores_bridge_matches_reference(kernel_calls, backend, case):
    """Paged FP4 index keys through a shuffled page table, keys past what a row can see poisoned
    (`tests.pallas_kernels.cases.indexer_case`). The TPU kernel equals the reference bit for bit;
    the GPU kernel may differ by one bf16 ulp where its own summation order meets a rounding tie."""
    args = indexer_case(*case).args()
    n_visible = np.asarray(args[-1])

    def run(impl):
        return np.asarray(jax.jit(lambda *a: kernels.index_scores(*a, impl=Impl.parse(impl)))(*args))

    ref = run("reference")
    out = run(f"pallas:{backend}:interpret")
    assert kernel_calls["index"] == 1
    visible = np.arange(ref.shape[-1])[None, None, :] < n_visible[..., None]
    assert visible.any() and not visible.all()
    for scores in (ref, out):
        assert np.isfinite(scores[visible]).all() and (scores[~visible] == -np.inf).all()
    scale = np.abs(ref[visible]).max()
    np.testing.assert_allclose(out[visible], ref[visible], rtol=2**-7, atol=2**-8 * scale)
    assert np.mean(out[visible] == ref[visible]) > 0.99
    if backend == "tpu":  # the reference's summation order in interpret mode
        np.testing.assert_array_equal(out, ref)


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


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_one_layer_prefill_pallas_equals_reference(kernel_calls, backend):
    """A ratio-2 layer (window FP8 + compressed FP4 segments, indexer on the paged index keys, MoE)
    of the tiny preset: prefill logits and decisions of impl=pallas:{backend}:interpret against
    impl=reference (pages of 16 tokens: 8 index keys per page, 4 pages per row)."""
    cfg, flat = _one_layer_tiny()
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 12)
    impl = f"pallas:{backend}:interpret"
    out = {}
    for name in ("reference", impl):
        model = Model(cfg, flat, hasher=None, tokenizer_path=None, impl=name)
        out[name] = model.logits(prompt, capture=True)
    assert kernel_calls == {"gmm": 3, "decode": 0, "prefill": 1, "index": 1}
    ref, got = out["reference"], out[impl]
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
