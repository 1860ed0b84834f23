"""Single-pass manifold-constrained hyper-connections (mHC), V4.1 flavour.

The residual is M parallel streams X: [B, T, M, D]. Each site (attention, FFN) derives
pre [M], post [M] and a Sinkhorn-normalised comb [M, M] from its own input streams; it expands
with its own post and comb, but collapses with the *previous* site's pre ("lagged" pre). The very
first collapse uses a one-hot on stream 0; the final one uses the last FFN site's pre.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ced_jax.layers.common import HIGHEST
from ced_jax.quant import exact_div, mean_last, round_bf16


def hc_mixes(
    x: jax.Array,
    fn: jax.Array,
    scale: jax.Array,
    base: jax.Array,
    *,
    hc: int,
    iters: int,
    norm_eps: float,
    hc_eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [B, T, M, D] -> pre [B, T, M], post [B, T, M], comb [B, T, M(j), M(k)] (all f32).

    One RMS statistic over the flattened M*D stream (no weight), a 24-wide projection, then the
    split; comb is a row softmax followed by Sinkhorn iterations ending on a column normalisation."""
    flat = x.reshape(*x.shape[:-2], -1)
    rsqrt = jax.lax.rsqrt(mean_last(jnp.square(flat)) + norm_eps)
    mixes = jnp.einsum("...k,nk->...n", flat, fn, precision=HIGHEST) * rsqrt
    pre = jax.nn.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * jax.nn.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*mixes.shape[:-1], hc, hc)
    comb = jnp.exp(comb - jnp.max(comb, axis=-1, keepdims=True))
    comb = exact_div(comb, jnp.sum(comb, axis=-1, keepdims=True)) + hc_eps
    comb = exact_div(comb, jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        comb = exact_div(comb, jnp.sum(comb, axis=-1, keepdims=True) + hc_eps)
        comb = exact_div(comb, jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)
    return pre, post, comb


def hc_collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    """sum_k pre_k X_k -> [B, T, D], rounded to bf16."""
    return round_bf16(jnp.sum(pre[..., None] * x, axis=-2))


def hc_expand(y: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k y + sum_j comb[j, k] X_j -> [B, T, M, D], rounded to bf16."""
    mixed = jnp.sum(comb[..., None] * residual[..., :, None, :], axis=-3)
    return round_bf16(post[..., None] * y[..., None, :] + mixed)
