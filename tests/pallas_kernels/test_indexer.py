"""Indexer scoring + top-k: both Pallas scoring kernels (interpret mode) equal the reference bit for
bit on paged FP4 keys with poisoned unused pages; the reference is the model's index_scores formula."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.model.layers import attention
from pallas_kernels import formats
from pallas_kernels.indexer import TileConfig, index_scores, index_topk, reference, select_topk
from tests.pallas_kernels.cases import indexer_case

CASE = (0, 2, 5, 8, 128, 128, 3)  # seed, B, T, I, Dk, keys per page, pages per sequence
TILES = {"tpu": TileConfig(rows=8), "gpu": TileConfig(rows=16)}


@pytest.fixture(scope="module")
def case_and_ref():
    case = indexer_case(*CASE)
    scores = jax.jit(reference.index_scores)(*case.args())
    topk = jax.jit(functools.partial(reference.index_topk, top_k=16))(*case.args())
    return case, np.asarray(scores), np.asarray(topk)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernel_matches_reference(case_and_ref, backend):
    case, scores, topk = case_and_ref
    kw = dict(backend=backend, interpret=True, config=TILES[backend])
    run = jax.jit(lambda *a: (index_topk(*a, top_k=16, **kw), index_scores(*a, **kw)))
    got_topk, got_scores = (np.asarray(x) for x in run(*case.args()))
    np.testing.assert_array_equal(got_scores, scores)
    np.testing.assert_array_equal(got_topk, topk)


@jax.jit
def _model_head_sum(q, weights, keys):
    s = formats.round_bf16(jnp.einsum("bthd,bsd->bths", q, keys, precision="highest"))
    s = formats.round_bf16(jax.nn.relu(s) * weights[..., None])
    return formats.round_bf16(jnp.sum(s, axis=2))


def test_reference_scores_are_the_models_formula(case_and_ref):
    """Against `ced_jax.model.layers.attention.index_scores`'s math on the unpacked keys (its projections
    bypassed): equal wherever its head sum (XLA's order) does not straddle a bf16 rounding tie."""
    case, scores, topk = case_and_ref
    b, t, heads, dk = case.q.shape
    table = np.clip(case.page_table, 0, None)
    keys = np.asarray(jax.jit(formats.unpack_index_keys)(case.key_pages[table].reshape(b, -1, 68)))
    model = np.asarray(_model_head_sum(case.q, case.weights, keys))
    visible = np.arange(keys.shape[1])[None, None] < case.n_visible[..., None]
    assert np.isfinite(scores[visible]).all() and np.all(scores[~visible] == -np.inf)
    assert np.mean(model[visible] == scores[visible]) > 0.999
    # The selection rule is the model's own `select_topk` (positions chosen so that n_visible holds).
    ratio = 1
    positions = jnp.asarray(case.n_visible * ratio - 1)
    np.testing.assert_array_equal(
        np.asarray(attention.select_topk(jnp.asarray(scores), positions, ratio, 16)),
        np.asarray(select_topk(jnp.asarray(scores), jnp.asarray(case.n_visible), 16)),
    )
    assert (topk[0, 0] == -1).all()  # nothing visible yet


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("per_page", [8, 16])
def test_small_pages_match_reference(backend, per_page):
    """Pages of 8 or 16 keys (what the model's small configs store per page: page_size / ratio) over
    several pages per sequence, read through a shuffled page table: equal to the reference."""
    case = indexer_case(1, 2, 5, 8, 128, per_page, 6)
    want = np.asarray(jax.jit(reference.index_scores)(*case.args()))
    kw = dict(backend=backend, interpret=True, config=TILES[backend])
    got = np.asarray(jax.jit(lambda *a: index_scores(*a, **kw))(*case.args()))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want).any() and np.isneginf(want).any()  # visible and invisible keys both met


def test_unsupported_shapes_raise_at_trace_time(case_and_ref):
    case, _, _ = case_and_ref
    args = case.args()
    with pytest.raises(ValueError, match="key_pages"):
        reference.index_scores(args[0], args[1], args[2][..., :64], args[3], args[4])
