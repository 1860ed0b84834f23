"""References of the FP8 block-scaled linear: rows [M, K] times dequant(weight [N, K], scales
[ceil(N/32), K/32])^T -> f32 [M, N].

`linear` is the XLA path's product (the weight dequantised, an f32 dot at HIGHEST precision, XLA's
order of sums). `linear_blocked` states the CPU kernel's order in numpy: each 32-value block of a row
against a weight row summed exactly (float64: FP8-quantised rows times e4m3 values give products and
block sums that float64 holds exactly), times the block's scale, rounded once to f32, the blocks
added in index order in f32."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from pallas_kernels import formats

BLOCK = 32


def validate(rows, weight, scales) -> tuple[int, int, int]:
    """(M, K, N) of a well-formed call, or a ValueError naming the argument."""
    if rows.ndim != 2:
        raise ValueError(f"rows must be [M, K], got shape {list(rows.shape)}")
    m, k = rows.shape
    if weight.ndim != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}] (K of the rows), got shape {list(weight.shape)}")
    n = weight.shape[0]
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of the scale block {BLOCK}")
    want = (-(-n // BLOCK), k // BLOCK)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales must be {list(want)} for a weight [{n}, {k}], got {list(scales.shape)}")
    return m, k, n


def linear(rows: jax.Array, weight: jax.Array, scales: jax.Array) -> jax.Array:
    validate(rows, weight, scales)
    w = formats.dequant_fp8_weight(weight, scales, BLOCK)
    return jax.lax.dot_general(rows, w, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST)


def linear_blocked(rows: np.ndarray, weight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    m, k, n = validate(rows, weight, scales)
    x = np.asarray(rows, np.float64).reshape(m, k // BLOCK, BLOCK)
    w = np.asarray(weight).view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(n, k // BLOCK, BLOCK)
    block_sums = np.einsum("mbj,nbj->mnb", x, w)  # exact in float64, whatever numpy's order
    factors = np.asarray(formats.np_ue8m0_to_f32(np.asarray(scales)), np.float64)  # [ceil(N/32), K/32]
    blocks = (block_sums * np.repeat(factors, BLOCK, axis=0)[:n][None]).astype(np.float32)
    out = blocks[..., 0].copy()
    for b in range(1, k // BLOCK):
        out = out + blocks[..., b]  # f32 + f32, in block order
    return out
