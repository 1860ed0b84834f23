"""Pure-jnp reference of the FP4 grouped matmul (see `common` for the contract).

Each row is multiplied by its own expert's dequantised weight in f32 at HIGHEST precision; rows are
processed in chunks so that device-size checks never materialise [M, N, K] at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import formats
from pallas_kernels.grouped_matmul.common import row_experts, validate_inputs
from pallas_kernels.run_order import products_in_run_order

ROW_CHUNK = 8


def gmm(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array) -> jax.Array:
    m, k, e, n = validate_inputs(lhs, w_packed, w_scale, group_sizes)
    expert, live = row_experts(group_sizes, m, e)
    chunk = min(ROW_CHUNK, m)
    pad = -m % chunk
    lhs_p = jnp.pad(jnp.where(live[:, None], lhs, 0.0), ((0, pad), (0, 0)))
    expert_p = jnp.pad(expert, (0, pad))

    def one_chunk(args):
        x, ids = args  # [chunk, K], [chunk]
        w = formats.dequant_fp4_weight(w_packed[ids], w_scale[ids])  # [chunk, N, K]
        return jnp.einsum("mk,mnk->mn", x, w, precision=jax.lax.Precision.HIGHEST)

    out = jax.lax.map(one_chunk, (lhs_p.reshape(-1, chunk, k), expert_p.reshape(-1, chunk)))
    out = out.reshape(-1, n)[:m]
    return jnp.where(live[:, None], out, 0.0)


def expert_rows_in_run_order(rows, ids, w_packed, w_scale) -> np.ndarray:
    """rows f32 [M, K] times expert ids[m]'s dequantised weight^T -> f32 [M, N], each output summed
    in XLA:CPU's order (`pallas_kernels.run_order`), which the CPU kernel (`kernel_cpu`) follows."""
    w = np.asarray(jax.jit(formats.dequant_fp4_weight)(w_packed[ids], w_scale[ids]))  # [M, N, K]
    return products_in_run_order(rows, w)
