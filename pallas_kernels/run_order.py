"""XLA:CPU's order of sums for an f32 product rows [M, K] x weight [N, K]^T, stated in numpy: each
output adds its products one by one in index order within runs of RUN values of K, each run from
zero, then adds the runs' sums in order (YNNPACK's, measured on jaxlib 0.10.2; `csrc/cpu_common.h`).
The CPU kernels sum in this order, so they give the XLA path's values bit for bit. The statement
rounds each product to f32, which is exact for the FP4 / FP8 products the kernels compute (FP8-
quantised rows times FP4 or FP8 weight values and power-of-two scales), where a fused multiply-add
gives the same value."""

from __future__ import annotations

import numpy as np

RUN = 512


def products_in_run_order(rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """rows f32 [M, K] times weight f32 [N, K] (one for all rows) or [M, N, K] (one per row) -> [M, N]."""
    x = np.asarray(rows, np.float32)
    w = np.asarray(weight, np.float32)
    if w.ndim == 2:
        w = w[None]
    m, k = x.shape
    total = None
    for start in range(0, k, RUN):
        acc = np.zeros((m, w.shape[1]), np.float32)
        for i in range(start, min(k, start + RUN)):
            acc += x[:, i, None] * w[:, :, i]  # f32 products, added one at a time
        total = acc if total is None else total + acc
    return total
