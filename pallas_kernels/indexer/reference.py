"""Pure-jnp reference of indexer scoring over paged FP4 keys, and top-k (contract in `common`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import formats
from pallas_kernels.indexer.common import select_topk, validate_inputs


def index_scores(q, weights, key_pages, page_table, n_visible) -> jax.Array:
    b, t, n_heads, _ = validate_inputs(q, weights, key_pages, page_table, n_visible)
    pages = jnp.clip(page_table, 0, key_pages.shape[0] - 1)
    keys = formats.unpack_index_keys(key_pages[pages].reshape(b, -1, key_pages.shape[-1]))  # [B, C, Dk]
    s = formats.round_bf16(jnp.einsum("btid,bcd->btic", q, keys, precision=jax.lax.Precision.HIGHEST))
    r = formats.round_bf16(jax.nn.relu(s) * weights[..., None])
    total = r[:, :, 0]
    for h in range(1, n_heads):  # head order, as the contract fixes it
        total = total + r[:, :, h]
    visible = jnp.arange(keys.shape[1])[None, None, :] < n_visible[..., None]
    return jnp.where(visible, formats.round_bf16(total), -jnp.inf)


def index_topk(q, weights, key_pages, page_table, n_visible, *, top_k: int, candidates=None) -> jax.Array:
    scores = index_scores(q, weights, key_pages, page_table, n_visible)
    return select_topk(scores, n_visible, top_k, candidates)
