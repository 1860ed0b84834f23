"""A Reindex layer scores only its candidate pool's entries (`kernels.index_scores_at`) instead of the
whole row masked to the pool: the scores of the pool's entries and the selected top-k are the same
bit for bit, for a decode step (one query) and a prefill page (16 queries), with ties, with fewer
candidates than k, and with queries that see only part of the pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.model.layers import attention, kernels
from pallas_kernels import formats

HEADS, DIM, PER_PAGE = 4, 128, 16


def _case(rng, *, rows, queries, pages, first_position):
    """Packed FP4 index keys in shuffled pages, FP4-valued queries, bf16 head weights."""
    keys = rng.standard_normal((rows * pages + 3, PER_PAGE, DIM)).astype(np.float32)
    keys[:, 0:4] = keys[:, 8:12]  # repeated keys in other blocks: tied scores across blocks
    key_pages = formats.pack_index_keys(jnp.asarray(keys))
    table = rng.permutation(rows * pages + 3)[: rows * pages].reshape(rows, pages).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((rows, queries, HEADS, DIM)), jnp.float32)
    q = formats.unpack_index_keys(formats.pack_index_keys(q))  # FP4 values, as the model's queries
    w = jnp.asarray(rng.standard_normal((rows, queries, HEADS)), jnp.bfloat16).astype(jnp.float32)
    positions = first_position[:, None] + np.arange(queries)[None, :]
    return q, w, key_pages, jnp.asarray(table), jnp.asarray(positions, jnp.int32)


@pytest.mark.parametrize(
    "queries, top_blocks, block, top_k",
    [(1, 6, 4, 16), (16, 6, 4, 16), (1, 3, 4, 16), (16, 2, 8, 8)],  # (1, 3, 4, 16): 12 < k candidates
)
def test_pool_scores_and_selection_equal_the_masked_whole_row(queries, top_blocks, block, top_k):
    rng = np.random.default_rng(queries * 100 + top_blocks)
    rows, pages, ratio = 3, 8, 1
    width = pages * PER_PAGE
    q, w, key_pages, table, positions = _case(
        rng, rows=rows, queries=queries, pages=pages, first_position=np.array([width - queries, 40, 5])
    )
    n_visible = (positions + 1) // ratio
    whole = kernels.index_scores(q, w, key_pages, table, n_visible)  # [B, T, S], impl reference
    # The pool from another layer's scores of the same row (the candidate source).
    source = kernels.index_scores(q[:, :, ::-1], w, key_pages, table, n_visible)
    mask, blocks = attention.candidate_pool(source, positions, ratio, top_blocks, block)
    masked = jnp.where(mask, whole, -jnp.inf)
    want = attention.select_topk(masked, positions, ratio, top_k)

    entries, valid = attention.candidate_entries(blocks, positions, ratio, block)
    got_scores = kernels.index_scores_at(q, w, key_pages, table, entries, valid)
    got = attention.select_topk(got_scores, positions, ratio, top_k, entries, width)

    in_row = np.clip(np.asarray(entries), 0, width - 1)
    np.testing.assert_array_equal(
        np.asarray(got_scores), np.where(valid, np.take_along_axis(np.asarray(masked), in_row, -1), -np.inf)
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(want) >= 0).sum() > 0  # something was selected
    # Ties exist among the pool's scores, so the tie rule was exercised.
    finite = np.asarray(got_scores)[np.isfinite(np.asarray(got_scores))]
    assert len(np.unique(finite)) < len(finite)


@pytest.mark.parametrize("queries", [1, 16])
def test_whole_row_scores_are_the_same_in_blocks(queries):
    """`kernels.index_scores` (impl reference) scores a long row in blocks of pages: the same scores bit
    for bit as the row in one piece, for blocks that divide the row and one that does not (the last
    block padded past the row), with rows that see all, part, or none of their slots."""
    rng = np.random.default_rng(7 + queries)
    rows, pages = 3, 10
    width = pages * PER_PAGE
    q, w, key_pages, table, positions = _case(
        rng, rows=rows, queries=queries, pages=pages, first_position=np.array([width - queries, 37, -queries])
    )
    n_visible = jnp.maximum(positions + 1, 0)
    whole = np.asarray(kernels.index_scores(q, w, key_pages, table, n_visible, block_entries=width))
    assert np.isfinite(whole).any() and np.isneginf(whole).any()
    for block_entries in (PER_PAGE, 2 * PER_PAGE, 3 * PER_PAGE):  # 10 pages: blocks of 1, 2, 3 pages
        got = kernels.index_scores(q, w, key_pages, table, n_visible, block_entries=block_entries)
        np.testing.assert_array_equal(np.asarray(got), whole, err_msg=f"block_entries={block_entries}")
    # A call whose rows all end early: the blocks past every row are skipped, the scores the same.
    short = jnp.minimum(n_visible, 2 * PER_PAGE + 3)
    whole = np.asarray(kernels.index_scores(q, w, key_pages, table, short, block_entries=width))
    assert np.isfinite(whole[..., : 2 * PER_PAGE + 3]).any() and np.isneginf(whole[..., 3 * PER_PAGE :]).all()
    for block_entries in (PER_PAGE, 2 * PER_PAGE, 3 * PER_PAGE):
        got = kernels.index_scores(q, w, key_pages, table, short, block_entries=block_entries)
        np.testing.assert_array_equal(np.asarray(got), whole, err_msg=f"short, block_entries={block_entries}")
    with pytest.raises(ValueError, match="block_entries must be >= 1"):
        kernels.index_scores(q, w, key_pages, table, n_visible, block_entries=0)
