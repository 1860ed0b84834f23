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
