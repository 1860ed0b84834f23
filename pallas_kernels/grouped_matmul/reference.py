"""Pure-jnp reference of the FP4 grouped matmul (see `common` for the contract).

Each row is multiplied by its own expert's dequantised weight in f32 at HIGHEST precision; rows are
processed in chunks so that device-size checks never materialise [M, N, K] at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import formats
from pallas_kernels.grouped_matmul.common import row_experts, validate_inputs

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


def _pow2(exponent: jax.Array) -> jax.Array:
    """2^exponent as f32 from integer exponents in the normal range, built from the exponent bits."""
    return jax.lax.bitcast_convert_type((exponent.astype(jnp.int32) + 127) << 23, jnp.float32)


def expert_rows_blocked(rows: jax.Array, ids: jax.Array, w_packed: jax.Array, w_scale: jax.Array):
    """rows f32 [M, K] (FP8-dequantised) times expert ids[m]'s dequantised weight^T -> f32 [M, N], in
    the CPU kernel's order (`kernel_cpu`): every 32-value block summed exactly and rounded once to f32,
    the blocks added in index order. Exactly, in integers: a block's values are multiples of
    2^(e - 17), e the exponent of its largest magnitude (an FP8 block spans less than 2^18 of its
    unit), and e2m1 values are halves, so a block's products sum in int32 without rounding."""
    m, k = rows.shape
    n, blocks = w_packed.shape[1], k // 32
    x = rows.reshape(m, blocks, 32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [M, Kb]
    exponent = jnp.maximum((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) - 127, -100)
    unit = _pow2(exponent - 17)
    x_int = (x * _pow2(17 - exponent)[..., None]).astype(jnp.int32)
    w_int = (formats.unpack_fp4_values(w_packed[ids]) * 2).astype(jnp.int32).reshape(m, n, blocks, 32)
    sums = jnp.einsum("mbj,mnbj->mnb", x_int, w_int, preferred_element_type=jnp.int32)
    values = sums.astype(jnp.float32) * (unit * 0.5)[:, None, :] * formats.ue8m0_to_f32(w_scale[ids])
    return jax.lax.fori_loop(1, blocks, lambda b, acc: acc + values[..., b], values[..., 0])
