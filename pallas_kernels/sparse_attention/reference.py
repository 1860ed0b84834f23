"""Pure-jnp reference of paged sparse attention over packed FP8 / FP4 entries (contract in `common`).

Entries are gathered through the page tables and unpacked with table lookups (`formats.unpack_*`),
then the formula of `ced_jax.model.layers.kernels.sparse_attention` is applied with every segment laid
out per query.
Invalid entries are zeroed before P.V, so garbage in unused pages cannot leak as 0 * NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import formats
from pallas_kernels.sparse_attention.common import NEG_FLOOR, finalize, resolve_rows, validate_inputs

HIGHEST = jax.lax.Precision.HIGHEST
_UNPACK = {"fp8": formats.unpack_fp8_entries, "fp4": formats.unpack_fp4_entries}


def sparse_attention_prefill(q, segments, sink, *, scale: float) -> jax.Array:
    """q f32 [B, T, H, D]; segments of (pages, page_table [B, n], idx [B, T, N]) -> f32 [B, T, H, D]."""
    _, _, _, _, fmts = validate_inputs(q, segments, sink, decode=False)
    scale = jnp.float32(scale)
    logits, keys = [], []
    for (pages, table, idx), fmt in zip(segments, fmts, strict=True):
        rows = resolve_rows(pages, table, idx)  # [B, T, N]
        valid = rows >= 0
        entries = pages.reshape(-1, pages.shape[-1])[jnp.maximum(rows, 0)]
        k = jnp.where(valid[..., None], _UNPACK[fmt](entries), 0.0)  # [B, T, N, D]
        s = jnp.einsum("bthd,btnd->bthn", q, k, precision=HIGHEST) * scale
        logits.append(jnp.where(valid[:, :, None, :], s, -jnp.inf))
        keys.append(k)
    row_max = jnp.maximum(jnp.max(jnp.concatenate(logits, -1), axis=-1), NEG_FLOOR)  # [B, T, H]
    denom = jnp.exp(sink.astype(jnp.float32) - row_max)
    out = jnp.zeros(q.shape, jnp.float32)
    for s, k in zip(logits, keys, strict=True):
        p = jnp.exp(s - row_max[..., None])
        denom = denom + jnp.sum(p, axis=-1)
        out = out + jnp.einsum("bthn,btnd->bthd", formats.round_bf16(p), k, precision=HIGHEST)
    return finalize(out, denom)


def sparse_attention_decode(q, segments, sink, *, scale: float) -> jax.Array:
    """q f32 [B, H, D]; segments of (pages, page_table [B, n], idx [B, N]) -> f32 [B, H, D]."""
    validate_inputs(q, segments, sink, decode=True)
    segs = [(pages, table, idx[:, None, :]) for pages, table, idx in segments]
    return sparse_attention_prefill(q[:, None], segs, sink, scale=scale)[:, 0]
