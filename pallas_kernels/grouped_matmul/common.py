"""Signature, input validation and tile configuration shared by the grouped-matmul reference and kernels.

gmm(lhs, w_packed, w_scale, group_sizes) -> f32 [M, N]:
  lhs          f32 [M, K]        rows sorted by expert (FP8-dequantised activations: bf16-exact)
  w_packed     u8  [E, N, K/2]   FP4 e2m1 codes, even K index in the low nibble
  w_scale      u8  [E, N, K/32]  ue8m0 scale bytes, one per 32 values along K
  group_sizes  i32 [E]           rows of each expert, in order; zeros allowed
Row r of group g (offsets[g] <= r < offsets[g+1]) gets lhs[r] . dequant(w[g])^T; rows at or past
sum(group_sizes) are zero. A sum beyond M is clipped to M (the trailing groups lose their rows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """tm rows x tn output columns per block; tk the contraction chunk (GPU kernel only)."""

    tm: int
    tn: int
    tk: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    vmem_limit_bytes: int | None = None


def validate_inputs(lhs, w_packed, w_scale, group_sizes) -> tuple[int, int, int, int]:
    """Static checks shared by reference and kernels; returns (M, K, E, N). Raises ValueError."""
    if lhs.ndim != 2 or lhs.dtype != jnp.float32:
        raise ValueError(f"lhs must be f32 [M, K], got {lhs.dtype}{list(lhs.shape)}")
    m, k = lhs.shape
    if w_packed.ndim != 3 or w_packed.dtype != jnp.uint8:
        raise ValueError(f"w_packed must be uint8 [E, N, K/2], got {w_packed.dtype}{list(w_packed.shape)}")
    e, n, half = w_packed.shape
    if k % 32 or half * 2 != k:
        raise ValueError(f"K={k} must be a multiple of 32 and equal 2 * w_packed.shape[-1]={2 * half}")
    if w_scale.dtype != jnp.uint8 or w_scale.shape != (e, n, k // 32):
        raise ValueError(f"w_scale must be uint8 {[e, n, k // 32]}, got {w_scale.dtype}{list(w_scale.shape)}")
    if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be int [{e}], got {group_sizes.dtype}{list(group_sizes.shape)}")
    return m, k, e, n


def group_offsets(group_sizes: jax.Array, m: int) -> jax.Array:
    """i32 [E + 1] row offsets of the groups, clipped to M."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def row_experts(group_sizes: jax.Array, m: int, e: int) -> tuple[jax.Array, jax.Array]:
    """Each of the M sorted rows' expert id (i32 [M]) and whether it lies inside a group (bool [M])."""
    offsets = group_offsets(group_sizes, m)
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.clip(jnp.searchsorted(offsets[1:], rows, side="right"), 0, e - 1).astype(jnp.int32)
    return expert, rows < offsets[-1]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
