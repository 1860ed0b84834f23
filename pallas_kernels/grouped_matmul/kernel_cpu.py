"""The FP4 expert product on CPU: an XLA FFI custom call (`pallas_kernels/csrc/fp4_expert_rows.cc`)
that decodes the packed weight inside the dot.

Its values are the XLA path's bit for bit: the same dequantised weight values, each output's
products summed in XLA:CPU's order (`pallas_kernels.run_order`; `reference.expert_rows_in_run_order`
states it in numpy), the same for every row alone or among others. The AVX-512 loop runs where the
CPU has it, else a portable one; `portable=True` forces the latter (the tests compare both).
Measured: BENCHMARKS.md, "CPU kernels through `jax.ffi`"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _cpu
from pallas_kernels.grouped_matmul.common import row_experts, validate_inputs


def _check_rows(rows, ids, packed, scales) -> None:
    if rows.ndim != 2 or rows.dtype != jnp.float32:
        raise ValueError(f"rows must be f32 [M, K], got {rows.dtype}{list(rows.shape)}")
    if ids.shape != rows.shape[:1] or ids.dtype != jnp.int32:
        raise ValueError(f"expert ids must be int32 [{rows.shape[0]}], got {ids.dtype}{list(ids.shape)}")
    validate_inputs(rows, packed, scales, jnp.zeros((packed.shape[0],), jnp.int32))


def expert_rows(rows: jax.Array, ids: jax.Array, packed: jax.Array, scales: jax.Array, *, portable=False):
    """rows f32 [M, K] times expert ids[m]'s dequantised FP4 weight^T -> f32 [M, N]. An id outside
    0..E-1 fails the call with an error naming the row."""
    _check_rows(rows, ids, packed, scales)
    _cpu.require()
    out = jax.ShapeDtypeStruct((rows.shape[0], packed.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call("ced_fp4_expert_rows", out)
    return call(rows, ids, packed, scales, portable=np.int64(bool(portable)))


def gmm(lhs: jax.Array, w_packed: jax.Array, w_scale: jax.Array, group_sizes: jax.Array, *, portable=False):
    """The grouped-matmul contract of `common` (rows sorted by expert, `group_sizes`) through
    `expert_rows`: rows at or past sum(group_sizes) are zero."""
    m, _, e, _ = validate_inputs(lhs, w_packed, w_scale, group_sizes)
    ids, live = row_experts(group_sizes, m, e)
    out = expert_rows(jnp.where(live[:, None], lhs, 0.0), ids, w_packed, w_scale, portable=portable)
    return jnp.where(live[:, None], out, 0.0)
