"""Helpers shared by the Pallas kernel bodies (jax only; everything here must lower for Mosaic TPU
and Triton as well as run in the HLO interpreter).

Tile-level dequantisation of the packed formats in `pallas_kernels.formats`. Two ways to spread one
scale over its block of values along the lane axis:
- `expand_scales_mxu` multiplies by a 0/1 expansion matrix on the matrix unit. Exact (one nonzero
  term, scales are bf16-exact), and a plain 2-D matmul is the operation Mosaic TPU is sure to lower,
  whereas a lane-splitting reshape may be rejected by its layout passes.
- `expand_scales_reshape` broadcasts and merges the trailing dims, which Triton lowers directly
  (power-of-two shapes) and which needs no dot with a short contraction (Triton's dot wants >= 16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import formats


def log2_exact(n: int) -> int:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return n.bit_length() - 1


def expand_scales_mxu(scales: jax.Array, block: int) -> jax.Array:
    """f32 [R, G] (bf16-exact values) -> f32 [R, G * block], each scale repeated `block` times."""
    g = scales.shape[-1]
    shift = log2_exact(block)
    col = jax.lax.broadcasted_iota(jnp.int32, (g, g * block), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (g, g * block), 0)
    expand = jnp.where((col >> shift) == row, 1.0, 0.0).astype(jnp.bfloat16)
    return jnp.dot(scales.astype(jnp.bfloat16), expand, preferred_element_type=jnp.float32)


def expand_scales_reshape(scales: jax.Array, block: int) -> jax.Array:
    """Same result as `expand_scales_mxu`, by broadcast + reshape."""
    r, g = scales.shape
    return jnp.broadcast_to(scales[:, :, None], (r, g, block)).reshape(r, g * block)


def fp4_halves(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 codes [R, K/2] -> f32 e2m1 values of the even (low nibble) and odd (high nibble) indices."""
    p = packed.astype(jnp.int32)
    return formats.decode_e2m1(p & 15), formats.decode_e2m1(p >> 4)


def interleave(even: jax.Array, odd: jax.Array) -> jax.Array:
    """[R, K/2] x 2 -> [R, K] with even[j] at 2j and odd[j] at 2j + 1 (Triton: a `join`)."""
    r, h = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(r, 2 * h)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [N, K]^T -> f32 [M, N], operands in bf16 (callers pass bf16-exact values, so
    every product is exact and only the f32 accumulation order is the kernel's own)."""
    return jax.lax.dot_general(
        a.astype(jnp.bfloat16),
        b.astype(jnp.bfloat16),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [K, N] -> f32 [M, N], operands in bf16 (see `dot_nt`)."""
    return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


# ------------------------------------------------------------- the reference's order on XLA:CPU
# In interpret mode a kernel body runs as XLA:CPU operations, where the order an f32 sum is taken in
# depends on the operation's form: a dot with bf16 operands runs through another CPU kernel than the
# reference path's f32 (HIGHEST) dot of the same exact products, a reduce sums in another order than
# the reference's product with ones (`ced_jax.invariant.sum_last`), and two half-width dots (FP4 even /
# odd columns) add in another order than one dot over the whole contraction. Each of these moves an
# f32 result by an ulp, and at a bf16 rounding tie the kernel's output by one bf16 ulp, which the
# model can amplify into a different top-k entry, expert or token. So the kernels take
# `reference_order=True` in interpret mode and then form their sums exactly as the reference does
# (the helpers below); on hardware (Mosaic, Triton) they keep bf16 operands, the matrix unit's native
# input, and a plain reduce: the same products, their own accumulation order.


def dot_nt_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """`dot_nt` with f32 operands at HIGHEST precision: the reference path's own product (same exact
    products, and on XLA:CPU the same summation order)."""
    return jax.lax.dot_general(
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def dot_nn_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """`dot_nn` with f32 operands at HIGHEST precision (see `dot_nt_f32`)."""
    return jax.lax.dot_general(
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        (((1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def row_sum(x: jax.Array, *, reference_order: bool) -> jax.Array:
    """f32 [R, N] -> f32 [R, 1], the sum over N. reference_order: as an f32 product against two
    columns of ones, the form of the reference's sum (`ced_jax.invariant.sum_last`; exact products, so
    only the accumulation order is the product's); otherwise a reduce."""
    if not reference_order:
        return x.sum(axis=1, keepdims=True)
    ones = jnp.ones((2, x.shape[-1]), jnp.float32)
    return dot_nt_f32(x, ones)[:, :1]
