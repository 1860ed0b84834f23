"""Signature, validation, tiles and the shared epilogue of the mHC mixing kernels.

hc_mixes(x, fn, scale, base, *, hc, iters, norm_eps, hc_eps) -> (pre, post, comb):
  x      f32 [T, hc * D]          each token's hc residual streams, flattened (bf16-exact values)
  fn     f32 [(2 + hc) * hc, hc * D]  the site's projection
  scale  f32 [3]                  the pre / post / comb scales
  base   f32 [(2 + hc) * hc]      the biases
  pre    f32 [T, hc]      sigmoid(m[:hc] * scale[0] + base[:hc]) + hc_eps
  post   f32 [T, hc]      2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])
  comb   f32 [T, hc, hc]  exp(c - max_k c) of c = m[2hc:] * scale[2] + base[2hc:] (rows j, columns k),
                          each row divided by its sum, + hc_eps, then divided by its column sums + hc_eps,
                          then iters - 1 times a row and a column normalisation (sum + hc_eps)
where m = (x . fn^T) * rsqrt(mean(x^2) + norm_eps): the model's `ced_jax.model.layers.mhc.hc_mixes`.
Short sums and maxima (over hc entries) are taken left to right; quotients are correctly rounded.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import formats


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """rows tokens per program; k_chunk the contraction chunk of the GPU kernel's loop."""

    rows: int = 8
    k_chunk: int = 256
    num_warps: int = 4
    num_stages: int = 2
    vmem_limit_bytes: int | None = None


def validate_inputs(x, fn, scale, base, hc: int) -> tuple[int, int, int]:
    """Static checks shared by the reference and the kernels; returns (T, K, mixes). Raises ValueError."""
    mixes = (2 + hc) * hc
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"x must be f32 [T, hc * D], got {x.dtype}{list(x.shape)}")
    t, k = x.shape
    if k % hc:
        raise ValueError(f"x's last dim {k} is not hc={hc} streams of equal width")
    if fn.dtype != jnp.float32 or fn.shape != (mixes, k):
        raise ValueError(f"fn must be f32 {[mixes, k]}, got {fn.dtype}{list(fn.shape)}")
    if scale.dtype != jnp.float32 or scale.shape != (3,):
        raise ValueError(f"scale must be f32 [3], got {scale.dtype}{list(scale.shape)}")
    if base.dtype != jnp.float32 or base.shape != (mixes,):
        raise ValueError(f"base must be f32 {[mixes]}, got {base.dtype}{list(base.shape)}")
    return t, k, mixes


def unpack(packed: jax.Array, t: int, hc: int):
    """The kernels' packed rows [T', W] (pre, post, comb row by row, then padding) -> (pre, post, comb)."""
    p = packed[:t]
    return p[:, :hc], p[:, hc : 2 * hc], p[:, 2 * hc : (2 + hc) * hc].reshape(t, hc, hc)


def _lane(values: jax.Array, j: int, exact: bool) -> jax.Array:
    """Column j of [R, W] as [R, 1]. On hardware a masked sum, exact (one term, the rest zeros), and an
    operation both Mosaic and Triton lower (Triton cannot slice a value). In interpret mode a slice:
    XLA:CPU may fuse a reduce with the exp or sigmoid that consumes it and hand the fusion to YNNPACK,
    whose exp differs in the last ulp (`ced_jax.quant`, row-invariant sums), so no reduce is used."""
    if exact:
        return values[:, j : j + 1]
    lane = jax.lax.broadcasted_iota(jnp.int32, values.shape, 1)
    return jnp.sum(jnp.where(lane == j, values, 0.0), axis=1, keepdims=True)


def epilogue(mixes, sum_sq, k: int, scale, base, *, hc, iters, norm_eps, hc_eps, width: int, exact: bool):
    """mixes [R, W] (x . fn^T, W >= (2 + hc) * hc), sum_sq [R, 1] (sum of x^2 over k values), scale
    [1, S >= 3], base [1, W] -> the packed rows [R, width]: pre, post, comb row-major, zeros after.
    exact (interpret mode, XLA:CPU): `formats.exact_div`, which keeps XLA from merging two divisions
    (its reduce_precision has no Mosaic or Triton lowering; there a quotient is the backend's own)."""
    div = formats.exact_div if exact else (lambda a, b: a / b)
    m = mixes * jax.lax.rsqrt(div(sum_sq, float(k)) + norm_eps)
    s_pre, s_post, s_comb = (_lane(scale, i, exact) for i in range(3))
    mix = lambda j, s: _lane(m, j, exact) * s + _lane(base, j, exact)
    pre = [jax.nn.sigmoid(mix(j, s_pre)) + hc_eps for j in range(hc)]
    post = [2 * jax.nn.sigmoid(mix(hc + j, s_post)) for j in range(hc)]
    c = [[mix(2 * hc + j * hc + i, s_comb) for i in range(hc)] for j in range(hc)]

    def left_to_right(op, terms):
        total = terms[0]
        for term in terms[1:]:
            total = op(total, term)
        return total

    rows = lambda c: [left_to_right(jnp.add, c[j]) for j in range(hc)]
    cols = lambda c: [left_to_right(jnp.add, [c[j][i] for j in range(hc)]) for i in range(hc)]
    c = [[jnp.exp(v - left_to_right(jnp.maximum, c[j])) for v in c[j]] for j in range(hc)]
    r = rows(c)
    c = [[div(c[j][i], r[j]) + hc_eps for i in range(hc)] for j in range(hc)]
    s = cols(c)
    c = [[div(c[j][i], s[i] + hc_eps) for i in range(hc)] for j in range(hc)]

    def step(_, flat):
        c = [list(flat[j * hc : (j + 1) * hc]) for j in range(hc)]
        r = rows(c)
        c = [[div(c[j][i], r[j] + hc_eps) for i in range(hc)] for j in range(hc)]
        s = cols(c)
        return tuple(div(c[j][i], s[i] + hc_eps) for j in range(hc) for i in range(hc))

    flat = jax.lax.fori_loop(0, iters - 1, step, tuple(v for row in c for v in row))
    values = pre + post + list(flat)
    lane = jax.lax.broadcasted_iota(jnp.int32, (m.shape[0], width), 1)
    out = jnp.zeros((m.shape[0], width), jnp.float32)
    for j, v in enumerate(values):
        out = jnp.where(lane == j, v, out)
    return out
