"""Paged sparse attention: the reference equals the model's `kernels.sparse_attention` on the unpacked
entries, and both Pallas kernels (interpret mode, decode and prefill) equal the reference on paged,
packed, NaN-poisoned caches with invalid ids, unused pages and a query with no valid entry."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.model.layers import kernels
from pallas_kernels.sparse_attention import (
    TileConfig,
    reference,
    sparse_attention_decode,
    sparse_attention_prefill,
)
from tests.pallas_kernels.cases import attention_case

# (seed, B, T, H, D, window (keys/page, pages/seq, ids/query), main (same)): tiny seeded shapes.
BOTH = (0, 2, 3, 4, 128, (8, 3, 12), (4, 6, 20))
FP8_ONLY = (1, 3, 2, 5, 64, (16, 2, 9), None)
FP4_ONLY = (2, 2, 2, 16, 64, None, (8, 4, 16))
TILES = {"tpu": TileConfig(rows=8), "gpu": TileConfig(heads=16, entries=16)}


@functools.cache
def _case(spec):
    seed, b, t, h, d, window, main = spec
    return attention_case(seed, b, t, h, d, window=window, main=main)


def _run(backend, decode, case):
    fn = sparse_attention_decode if decode else sparse_attention_prefill
    q, segs, sink = case.args(decode)
    kw = dict(scale=case.scale, backend=backend, interpret=True, config=TILES[backend])
    return np.asarray(jax.jit(functools.partial(fn, **kw))(q, segs, sink))


def _reference(decode, case):
    fn = reference.sparse_attention_decode if decode else reference.sparse_attention_prefill
    q, segs, sink = case.args(decode)
    return np.asarray(jax.jit(functools.partial(fn, scale=case.scale))(q, segs, sink))


@pytest.mark.parametrize(
    "backend,decode,spec",
    [
        ("tpu", True, BOTH),
        ("tpu", False, BOTH),
        ("gpu", True, BOTH),
        ("gpu", False, BOTH),
        ("tpu", False, FP8_ONLY),
        ("gpu", True, FP4_ONLY),
    ],
    ids=[
        "tpu-decode",
        "tpu-prefill",
        "gpu-decode",
        "gpu-prefill",
        "tpu-prefill-fp8only",
        "gpu-decode-fp4only",
    ],
)
def test_kernel_matches_reference(backend, decode, spec):
    case = _case(spec)
    ref = _reference(decode, case)
    out = _run(backend, decode, case)
    assert np.isfinite(ref).all() and np.isfinite(out).all()
    assert not (ref[0] if decode else ref[0, 0]).any()  # the query with no valid entry
    # Equal up to the f32 summation order inside the dots, i.e. at most one bf16 ulp after rounding.
    np.testing.assert_allclose(out, ref, rtol=2**-7, atol=1e-6)
    assert np.mean(out == ref) > 0.98


@pytest.mark.parametrize("backend,decode", [("tpu", True), ("gpu", False)], ids=["tpu-decode", "gpu-prefill"])
def test_corrupt_selected_entry_is_loud(backend, decode):
    """A *selected* entry that decodes to NaN makes exactly the queries selecting it NaN, in the
    kernels as in the reference: only unselected garbage is masked, never a valid entry."""
    case = _case(BOTH)
    pages, table, idx = case.segments[1]
    bi = 1
    ids = idx[bi, 0] if decode else idx[bi, 1]
    j = int(ids[ids >= 0][0])
    corrupt = pages.copy()
    corrupt[table[bi, j // pages.shape[1]], j % pages.shape[1]] = 0xFF
    case.segments[1] = (corrupt, table, idx)
    try:
        ref, out = _reference(decode, case), _run(backend, decode, case)
    finally:
        case.segments[1] = (pages, table, idx)
    nan_q = np.isnan(ref).any(axis=(-2, -1))
    assert nan_q[bi] if decode else nan_q[bi, 1]
    assert not nan_q.all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    fine = ~np.isnan(ref)
    np.testing.assert_allclose(out[fine], ref[fine], rtol=2**-7, atol=1e-6)


@jax.jit
def _model_formula(q, segs, sink):
    """kernels.sparse_attention (the model's reference) on the same pages, page tables and ids."""
    model_segments = [
        kernels.KeySegment(pages, table, jnp.maximum(idx, 0), idx >= 0) for pages, table, idx in segs
    ]
    return kernels.sparse_attention(q, model_segments, sink, q.shape[-1] ** -0.5)


def test_reference_is_the_models_formula():
    case = _case(BOTH)
    q, segs, sink = case.args(decode=False)
    np.testing.assert_array_equal(_reference(False, case), np.asarray(_model_formula(q, segs, sink)))


def test_reference_discriminates_page_tables():
    """Negative control: pointing a sequence at the wrong pages changes (here: poisons) the output."""
    case = _case(BOTH)
    good = _reference(False, case)
    pages, table, idx = case.segments[1]
    case.segments[1] = (pages, np.roll(table, 1, axis=0), idx)
    try:
        bad = _reference(False, case)
    finally:
        case.segments[1] = (pages, table, idx)
    assert not np.allclose(np.nan_to_num(bad, nan=1e9), good)


def test_unsupported_shapes_raise_at_trace_time():
    case = _case(BOTH)
    q, segs, sink = case.args(decode=True)
    with pytest.raises(NotImplementedError, match=">= 16"):
        jax.eval_shape(
            lambda q, s, k: sparse_attention_decode(
                q, s, k, scale=0.1, backend="gpu", interpret=True, config=TileConfig(heads=8)
            ),
            q,
            segs,
            sink,
        )
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        jax.eval_shape(
            lambda q, s, k: sparse_attention_prefill(
                q[:, None].repeat(5, 1),
                [(p, t, i[:, None].repeat(5, 1)) for p, t, i in s],
                k,
                scale=0.1,
                backend="tpu",
                interpret=True,
                config=TileConfig(rows=4),
            ),
            q,
            segs,
            sink,
        )
    with pytest.raises(ValueError, match="neither FP8"):
        bad = [(segs[0][0][..., :-1], segs[0][1], segs[0][2])]
        reference.sparse_attention_decode(q, bad, sink, scale=0.1)
