"""Single-pass manifold-constrained hyper-connections (mHC), V4.1 flavour.

The residual is M parallel streams X: [B, T, M, D]. Each site (attention, FFN) derives
pre [M], post [M] and a Sinkhorn-normalised comb [M, M] from its own input streams; it expands
with its own post and comb, but collapses with the *previous* site's pre ("lagged" pre). The very
first collapse uses a one-hot on stream 0; the final one uses the last FFN site's pre.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ced_jax.invariant import matmul_rows, max_small, mean_last, rounded_product, sum_small
from ced_jax.quant import exact_div, round_bf16


@partial(jax.jit, static_argnames=("hc", "iters", "norm_eps", "hc_eps"))
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
    mixes = matmul_rows(flat, fn) * rsqrt
    pre = jax.nn.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * jax.nn.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*mixes.shape[:-1], hc, hc)
    comb = jnp.exp(comb - max_small(comb, -1)[..., None])  # no reduce: see ced_jax.quant
    # The products here are not fenced (`rounded_product`): fenced, tiny-v2's DSpark gate weights move
    # off the reference's (PARITY.md, "RMS norms in torch's order").
    return pre, post, sinkhorn(comb, iters=iters, eps=hc_eps)


def sinkhorn(comb: jax.Array, *, iters: int, eps: float) -> jax.Array:
    """[..., M, M] positive f32 (a row softmax's numerators) -> the row softmax + eps, then `iters`
    column and iters - 1 row normalisations, alternating and ending on a column one; each sum in
    index order, each quotient correctly rounded, as the reference computes them."""
    row_sum = lambda c: sum_small(c, -1)[..., None]
    col_sum = lambda c: sum_small(c, -2)[..., None, :]
    comb = exact_div(comb, row_sum(comb)) + eps
    comb = exact_div(comb, col_sum(comb) + eps)

    def step(_, c):
        c = exact_div(c, row_sum(c) + eps)
        return exact_div(c, col_sum(c) + eps)

    # A loop, not unrolled: the program holds one step whatever `iters` is (unrolled, the 19 steps
    # were 1,300 of tiny's 2,366 decode fusions and a sixth of its compile time).
    return jax.lax.fori_loop(0, iters - 1, step, comb)


def hc_collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    """sum_k pre_k X_k -> [B, T, D] (each product rounded before the sum), rounded to bf16."""
    return round_bf16(sum_small(rounded_product(pre[..., None], x), -2))


def hc_expand(y: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k y + sum_j comb[j, k] X_j -> [B, T, M, D], rounded to bf16."""
    mixed = sum_small(rounded_product(comb[..., None], residual[..., :, None, :]), -3)
    return round_bf16(rounded_product(post[..., None], y[..., None, :]) + mixed)


def stream_mean(x: jax.Array) -> jax.Array:
    """f32 mean over the M streams of [..., M, D] (the sum in stream order, divided exactly by M), not
    rounded: one order per row whatever the row count (`ced_jax.invariant.sum_small`)."""
    return exact_div(sum_small(x, -2), float(x.shape[-2]))
