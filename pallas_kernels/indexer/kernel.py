"""The Pallas indexer scoring (+ XLA top-k) over the per-backend kernels; see
`pallas_kernels._backend.resolve_backend` for the backend choice. No fallback."""

from __future__ import annotations

import jax

from pallas_kernels._backend import resolve_backend
from pallas_kernels.indexer import kernel_tpu, kernel_triton
from pallas_kernels.indexer.common import TileConfig

_MODULES = {"tpu": kernel_tpu, "gpu": kernel_triton}


def index_scores(
    q: jax.Array,  # f32 [B, T, I, Dk]
    weights: jax.Array,  # f32 [B, T, I]
    key_pages: jax.Array,  # u8 [P, S, Dk/2 + Dk/32]
    page_table: jax.Array,  # i32 [B, pages_per_seq]
    n_visible: jax.Array,  # i32 [B, T]
    *,
    backend: str | None = None,
    interpret=False,
    config: TileConfig | None = None,
) -> jax.Array:  # f32 [B, T, pages_per_seq * S]
    module = _MODULES[resolve_backend(backend, interpret)]
    return module.index_scores(
        q, weights, key_pages, page_table, n_visible, interpret=interpret, config=config
    )


def index_topk(
    q,
    weights,
    key_pages,
    page_table,
    n_visible,
    *,
    top_k: int,
    candidates=None,
    backend=None,
    interpret=False,
    config: TileConfig | None = None,
) -> jax.Array:  # i32 [B, T, X]
    module = _MODULES[resolve_backend(backend, interpret)]
    return module.index_topk(
        q,
        weights,
        key_pages,
        page_table,
        n_visible,
        top_k=top_k,
        candidates=candidates,
        interpret=interpret,
        config=config,
    )
