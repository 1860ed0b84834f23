"""References of the FP8 block-scaled linear: rows [M, K] times dequant(weight [N, K], scales
[ceil(N/32), K/32])^T -> f32 [M, N].

`linear` is the XLA path's product (the weight dequantised, an f32 dot at HIGHEST precision, XLA's
order of sums). `linear_in_run_order` states that order in numpy (`pallas_kernels.run_order`), which
the CPU kernel follows."""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels import formats
from pallas_kernels.run_order import products_in_run_order

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


def linear_in_run_order(rows: np.ndarray, weight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    validate(rows, weight, scales)
    w = np.asarray(jax.jit(formats.dequant_fp8_weight)(weight, scales))  # the XLA path's f32 values
    return products_in_run_order(rows, w)
