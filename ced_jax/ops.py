"""The one seam between the model and its kernels. Selection is explicit (`impl=`); an
unsupported implementation or shape raises, there is never a silent fallback.

impl="reference" is the pure-jnp path (the default on CPU and the parity target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ced_jax.quant import dequant_fp4_weight, exact_div, round_bf16

IMPLS = ("reference",)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise NotImplementedError(f"impl={impl!r} is not available; choose one of {IMPLS}")


def expert_matmul(rows: jax.Array, expert_ids: jax.Array, w: dict, *, impl: str = "reference") -> jax.Array:
    """rows [M, K] (FP8-dequantised activations) times each row's expert weight^T -> f32 [M, N].

    w: {'weight': u8 packed FP4 [E, N, K/2], 'scale': u8 e8m0 [E, N, K/32]}.
    Few rows (decode) gather only the touched experts; many rows sort by expert and use
    `lax.ragged_dot` over the dequantised expert stack. Both compute the same products in f32."""
    _check_impl(impl)
    num_experts = w["weight"].shape[0]
    m = rows.shape[0]
    if m < num_experts:
        weight = dequant_fp4_weight(w["weight"][expert_ids], w["scale"][expert_ids])  # [M, N, K]
        return jnp.einsum("mk,mnk->mn", rows, weight, precision=jax.lax.Precision.HIGHEST)
    order = jnp.argsort(expert_ids)
    group_sizes = jnp.bincount(expert_ids, length=num_experts).astype(jnp.int32)
    weight = dequant_fp4_weight(w["weight"], w["scale"])  # [E, N, K]
    out_sorted = jax.lax.ragged_dot(
        rows[order], jnp.swapaxes(weight, 1, 2), group_sizes, precision=jax.lax.Precision.HIGHEST
    )
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)


def sparse_attention(
    q: jax.Array,
    segments: list[tuple[jax.Array, jax.Array, str]],
    sink: jax.Array,
    scale: float,
    *,
    impl: str = "reference",
) -> jax.Array:
    """Single-KV-head attention (V = K) over several key segments, with a per-head sink.

    q: [B, T, H, Dh]. Each segment is (keys, valid, layout): layout "shared" has keys [B, S, Dh]
    with valid [B, T, S] (window ring, chunk); layout "per_query" has keys [B, T, S, Dh] with valid
    [B, T, S] (gathered compressed entries). The sink adds exp(sink_h) to the denominator only;
    probabilities are rounded to bf16 before P.V (the reference's rounding point); a row with no
    valid key returns zeros. Output [B, T, H, Dh], rounded to bf16."""
    _check_impl(impl)
    scale = jnp.float32(scale)
    logits = []
    for keys, valid, layout in segments:
        eq = "bthd,bsd->bths" if layout == "shared" else "bthd,btsd->bths"
        s = jnp.einsum(eq, q, keys, precision=jax.lax.Precision.HIGHEST) * scale
        logits.append(jnp.where(valid[:, :, None, :], s, -jnp.inf))
    row_max = jnp.maximum(jnp.max(jnp.concatenate(logits, -1), axis=-1), -1e30)  # [B, T, H]
    denom = jnp.exp(sink.astype(jnp.float32) - row_max)
    out = jnp.zeros(q.shape, jnp.float32)
    for (keys, _, layout), s in zip(segments, logits, strict=True):
        p = jnp.exp(s - row_max[..., None])
        denom = denom + jnp.sum(p, axis=-1)
        eq = "bths,bsd->bthd" if layout == "shared" else "bths,btsd->bthd"
        out = out + jnp.einsum(eq, round_bf16(p), keys, precision=jax.lax.Precision.HIGHEST)
    return round_bf16(exact_div(out, denom[..., None]))
