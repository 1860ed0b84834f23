"""The FP8 block-scaled linear on CPU: an XLA FFI custom call (`pallas_kernels/csrc/fp8_linear_rows.cc`)
that decodes the e4m3 weight inside the dot, so no f32 copy of the weight is ever written.

Its values are the XLA path's bit for bit: the same dequantised weight values, each output's
products summed in XLA:CPU's order (`pallas_kernels.run_order`; `reference.linear_in_run_order`
states it in numpy), the same for every row alone or among others. The AVX-512 loop runs where the
CPU has it, else a portable one; `portable=True` forces the latter (the tests compare both).
Measured: BENCHMARKS.md, "CPU kernels through `jax.ffi`"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _cpu
from pallas_kernels.fp8_linear.reference import BLOCK, validate

__all__ = ["BLOCK", "linear_rows"]


def linear_rows(rows: jax.Array, weight: jax.Array, scales: jax.Array, *, portable: bool = False):
    """rows f32 [M, K] times dequant(weight e4m3 [N, K], scales ue8m0 [ceil(N/32), K/32])^T -> f32
    [M, N]. The weight may be float8_e4m3fn or its uint8 codes; the scales uint8 exponent bytes."""
    m, _, n = validate(rows, weight, scales)
    if rows.dtype != jnp.float32:
        raise ValueError(f"rows must be f32, got {rows.dtype}")
    if weight.dtype not in (jnp.float8_e4m3fn, jnp.uint8) or scales.dtype != jnp.uint8:
        raise ValueError(
            f"weight must be float8_e4m3fn or uint8 and scales uint8, got {weight.dtype} and {scales.dtype}"
        )
    _cpu.require()
    call = jax.ffi.ffi_call("ced_fp8_linear_rows", jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(rows, weight, scales, portable=np.int64(bool(portable)))
