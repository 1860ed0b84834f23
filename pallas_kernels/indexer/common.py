"""Contract and validation shared by the indexer-scoring reference and kernels, and the XLA top-k.

Letters: B sequences, T queries, I indexer heads, Dk index head dim, P pages, S keys per page,
C = pages_per_seq * S key slots per sequence, X = top_k.

    index_scores(q [B, T, I, Dk], weights [B, T, I], key_pages, page_table, n_visible) -> f32 [B, T, C]
    q          f32 [B, T, I, Dk]   FP4-fake-quantised index queries (bf16-exact)
    weights    f32 [B, T, I]       per-head weights, bf16-rounded, softmax scale folded in
    key_pages  u8  [P, S, Dk/2 + Dk/32]   FP4 index keys (68 B for Dk = 128)
    page_table i32 [B, pages_per_seq]     physical page of each logical page
    n_visible  i32 [B, T]          keys 0 .. n_visible-1 of the sequence are visible to the query

score[b, t, j] = bf16( sum_h bf16( relu( bf16(q_h . k_j) ) * w_h ) ) for j < n_visible, else -inf,
the head sum taken in f32 in head order 0, 1, ..., I-1 (fixed, so kernels and reference agree to
the bit; `ced_jax.model.layers.attention.index_scores` is this formula with XLA's own summation order).
Pages of the table past a query's visible keys are never read (entries -1 / garbage allowed).

`select_topk` then keeps the X best visible keys (ties: lower index first, as `lax.top_k`), sorted
ascending, -1 for none: the model's `select_topk`. It stays an XLA `lax.top_k`: a sort-based
selection has no Pallas advantage on either backend, and the scores it reads are 4 bytes per key
against the 68 the scoring reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import formats


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """rows: queries per block (TPU: multiple of 8; GPU: power of two >= 16)."""

    rows: int = 8
    num_warps: int = 4
    num_stages: int = 2
    vmem_limit_bytes: int | None = None


def validate_inputs(q, weights, key_pages, page_table, n_visible) -> tuple[int, int, int, int]:
    """Static checks shared by reference and kernels; returns (B, T, I, Dk). Raises ValueError."""
    if q.ndim != 4 or q.dtype != jnp.float32:
        raise ValueError(f"q must be f32 [B, T, I, Dk], got {q.dtype}{list(q.shape)}")
    b, t, i, dk = q.shape
    if dk % 32:
        raise ValueError(f"index head dim {dk} must be a multiple of 32")
    if weights.shape != (b, t, i) or weights.dtype != jnp.float32:
        raise ValueError(f"weights must be f32 {[b, t, i]}, got {weights.dtype}{list(weights.shape)}")
    if (
        key_pages.ndim != 3
        or key_pages.dtype != jnp.uint8
        or key_pages.shape[-1] != formats.index_key_bytes(dk)
    ):
        raise ValueError(
            f"key_pages must be uint8 [P, S, {formats.index_key_bytes(dk)}], "
            f"got {key_pages.dtype}{list(key_pages.shape)}"
        )
    if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be int [{b}, pages_per_seq], got {list(page_table.shape)}")
    if n_visible.shape != (b, t) or not jnp.issubdtype(n_visible.dtype, jnp.integer):
        raise ValueError(f"n_visible must be int {[b, t]}, got {list(n_visible.shape)}")
    return b, t, i, dk


def select_topk(scores: jax.Array, n_visible: jax.Array, top_k: int, candidates=None) -> jax.Array:
    """scores f32 [B, T, C] -> i32 [B, T, min(X, C)]: best visible ids ascending, -1 = none.
    candidates: optional bool [B, T, C] restricting the choice (a Reindex layer's pool)."""
    if candidates is not None:
        scores = jnp.where(candidates, scores, -jnp.inf)
    values, ids = jax.lax.top_k(scores, min(top_k, scores.shape[-1]))
    valid = (values > -jnp.inf) & (ids < n_visible[..., None])
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(valid, ids, big), axis=-1)
    return jnp.where(ordered == big, -1, ordered).astype(jnp.int32)


def pages_needed(n_visible: jax.Array, per_page: int, pages_per_seq: int) -> jax.Array:
    """i32 [B]: pages holding any key visible to some query of the sequence (at least 1)."""
    most = jnp.max(n_visible, axis=1)
    return jnp.clip((most + per_page - 1) // per_page, 1, pages_per_seq).astype(jnp.int32)
