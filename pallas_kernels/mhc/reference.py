"""Pure-jnp reference of the mHC mixing (contract in `common`): the formula with XLA's own sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mhc.common import validate_inputs


def hc_mixes(x, fn, scale, base, *, hc: int, iters: int, norm_eps: float, hc_eps: float):
    t, k, _ = validate_inputs(x, fn, scale, base, hc)
    hp = jax.lax.Precision.HIGHEST
    m = jnp.dot(x, fn.T, precision=hp) * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    pre = jax.nn.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * jax.nn.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    c = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(t, hc, hc)
    c = jnp.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return pre, post, c
