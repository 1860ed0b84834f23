"""Engram: an n-gram hash lookup written into every residual stream, gated per stream.

The hash ids ([B, T, C] rows of this layer's table, C = (N-1) * heads) are computed on the host
(`ced_jax.engram_hash`): the hash needs 64-bit integer arithmetic and only depends on token ids.
Where the table lives is the Engram placement: on device the layer gets the ids and gathers from its
parameters (`p["embed"]`); off device (`ced_jax.engram_store`) it gets the gathered rows themselves,
{"weight": FP8 [B, T, C, ehd], "scale": ue8m0 [B, T, C, ehd / 32]}, and applies the same
dequantisation (`engram_dequant`) to them, so both placements give the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ced_jax.invariant import mean_last, sum_last
from ced_jax.model.layers.common import fp8_linear
from ced_jax.options import REFERENCE, Impl
from ced_jax.quant import e8m0_to_f32, round_bf16


def engram_dequant(values: jax.Array, scales: jax.Array, block: int = 32) -> jax.Array:
    """Gathered FP8 rows [..., head_dim] times their ue8m0 scale bytes [..., head_dim / block]
    -> f32 (bf16-exact)."""
    values = values.astype(jnp.float32)
    scales = jnp.repeat(e8m0_to_f32(scales), block, axis=-1)
    return round_bf16(values * scales)


def engram_lookup(table: jax.Array, table_scale: jax.Array, rows: jax.Array, block: int = 32) -> jax.Array:
    """FP8 table rows times their ue8m0 scales per `block` -> f32 [..., C, head_dim] (bf16-exact)."""
    return engram_dequant(table[rows], table_scale[rows], block)


def engram(
    x: jax.Array,
    rows: jax.Array | dict,
    p: dict,
    *,
    eps: float,
    token_mask: jax.Array | None = None,
    impl: Impl = REFERENCE,
) -> jax.Array:
    """x: [B, T, M, D] residual streams; rows: i32 [B, T, C] ids into p["embed"] (tables on device),
    or the gathered rows {"weight": FP8 [B, T, C, ehd], "scale": u8 [B, T, C, ehd / 32]} (tables on
    the host: p has no "embed"). Returns the updated streams."""
    hc, dim = x.shape[-2:]
    if isinstance(rows, dict):
        if "embed" in p:
            raise ValueError(
                "engram: gathered rows given, but the parameters hold the table (placement device)"
            )
        emb = engram_dequant(rows["weight"], rows["scale"])
    else:
        if "embed" not in p:
            raise ValueError("engram: row ids given, but the parameters hold no table (placement host)")
        emb = engram_lookup(p["embed"]["weight"], p["embed"]["scale"], rows)
    kv = fp8_linear(emb.reshape(*emb.shape[:-2], -1), p["wkv"], impl=impl)
    key = kv[..., : hc * dim].reshape(*kv.shape[:-1], hc, dim)
    value = kv[..., hc * dim :]
    weight = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    # normalised per (token, stream) over D, not jointly over the streams
    rstd = jax.lax.rsqrt(mean_last(jnp.square(x))[..., 0] + eps) * jax.lax.rsqrt(
        mean_last(jnp.square(key))[..., 0] + eps
    )
    dot = sum_last(x * weight * key)[..., 0] * rstd * dim**-0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return round_bf16(x + gate[..., None] * value[..., None, :])
