"""The Pallas paged sparse attention: decode and prefill entry points over the per-backend kernels.

backend "tpu" runs `kernel_tpu` (Mosaic), "gpu" runs `kernel_triton`; None picks the default
backend's (see `pallas_kernels._backend.resolve_backend`). No fallback: unsupported
shapes raise NotImplementedError while tracing.
"""

from __future__ import annotations

import jax

from pallas_kernels._backend import resolve_backend
from pallas_kernels.sparse_attention import kernel_tpu, kernel_triton
from pallas_kernels.sparse_attention.common import TileConfig

_MODULES = {"tpu": kernel_tpu, "gpu": kernel_triton}


def sparse_attention_decode(
    q: jax.Array,  # f32 [B, H, D]
    segments,  # [(u8 [P, S, bytes], i32 [B, pages_per_seq], i32 [B, N])]
    sink: jax.Array,  # f32 [H]
    *,
    scale: float,
    backend: str | None = None,
    interpret=False,
    config: TileConfig | None = None,
) -> jax.Array:  # f32 [B, H, D]
    module = _MODULES[resolve_backend(backend, interpret)]
    return module.sparse_attention_decode(q, segments, sink, scale=scale, interpret=interpret, config=config)


def sparse_attention_prefill(
    q: jax.Array,  # f32 [B, T, H, D]
    segments,  # [(u8 [P, S, bytes], i32 [B, pages_per_seq], i32 [B, T, N])]
    sink: jax.Array,  # f32 [H]
    *,
    scale: float,
    backend: str | None = None,
    interpret=False,
    config: TileConfig | None = None,
) -> jax.Array:  # f32 [B, T, H, D]
    module = _MODULES[resolve_backend(backend, interpret)]
    return module.sparse_attention_prefill(q, segments, sink, scale=scale, interpret=interpret, config=config)
