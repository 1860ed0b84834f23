"""The fake quantisation that is part of V4.1's semantics, over the codecs of `pallas_kernels.formats`.

Conventions
- Activations travel as float32 arrays whose values are exactly representable in bfloat16
  (`round_bf16` marks every point where DeepSeek's reference rounds to bf16). XLA:CPU runs f32
  far faster than bf16, and the values (hence the numerics) are the same.
- FP8 is e4m3fn; scales are ue8m0 (a power of two) stored as the raw exponent byte (uint8,
  value 2^(e-127)). FP4 is e2m1, two codes per byte, the even index in the low nibble. The byte
  layouts, the rounding primitives and the weight dequantisers are `pallas_kernels.formats`'; this
  module holds the model's scale rules (the reference's act_quant and its FP4 variants).
- Fake quantisation returns the dequantised values (what the reference writes back in place),
  so every downstream GEMM is exact over dequantised products. `formats.pack_*` stores them
  losslessly in the KV cache's packed entries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# The codecs and rounding primitives live in `pallas_kernels.formats`; the names the model's layers
# use are re-exported here (`e8m0_to_f32` is formats' `ue8m0_to_f32`).
from pallas_kernels.formats import (
    FP4_MAX,
    FP4_TABLE,
    FP8_MAX,
    dequant_fp4_weight,
    dequant_fp8_weight,
    e2m1_codes_scaled,
    e2m1_to_f32,
    exact_div,
    fp4_e4m3_block_scale,
    round_bf16,
    round_e4m3,
    split_blocks,
)
from pallas_kernels.formats import ue8m0_to_f32 as e8m0_to_f32

__all__ = [
    "FP4_MAX",
    "FP4_TABLE",
    "FP8_MAX",
    "dequant_fp4_weight",
    "dequant_fp8_weight",
    "e2m1_codes_scaled",
    "e8m0_to_f32",
    "exact_div",
    "fp4_fake_quant_e4m3",
    "fp4_fake_quant_ue8m0",
    "fp8_fake_quant",
    "expert_weight",
    "fp8_quantize",
    "linear_weight",
    "matmul_rows",
    "max_axis",
    "max_fenced",
    "max_small",
    "mean_last",
    "pow2_reciprocal",
    "pow2_scale_ceil",
    "round_bf16",
    "round_e4m3",
    "sum_axis",
    "sum_last",
    "sum_small",
]

# The reference multiplies by the reciprocal as an fp32 constant before rounding the scale up.
_FP8_MAX_INV = np.float32(1.0 / FP8_MAX)
_FP4_MAX_INV = np.float32(1.0 / FP4_MAX)


def pow2_scale_ceil(amax: jax.Array, max_inv: np.float32) -> jax.Array:
    """2^ceil(log2(amax * max_inv)) by exponent bits: the ue8m0 'fast round scale'."""
    x = amax.astype(jnp.float32) * max_inv
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa_nonzero = (bits & 0x7FFFFF) != 0
    log2_ceil = exponent - 127 + mantissa_nonzero.astype(jnp.int32)
    return jax.lax.bitcast_convert_type((log2_ceil + 127) << 23, jnp.float32)


# ------------------------------------------------------------------ weights in either layout
# A quantised weight is a dict: {'weight', 'scale'} as released, or {'weight'} in f32 when the model
# was loaded with a dequantised layout (`ced_jax.checkpoint.weight_layout`). Both give the same f32 values.


def linear_weight(p: dict, block: int = 32) -> jax.Array:
    """An FP8 linear's weight as f32 [N, K]: dequantised from e4m3 + ue8m0 block scales, or the f32
    weight a dequantised layout holds."""
    if "scale" in p:
        return dequant_fp8_weight(p["weight"], p["scale"], block)
    return p["weight"]


def expert_weight(p: dict, index=None) -> jax.Array:
    """Routed-expert weights as f32 [..., N, K], `index` (an int, ids or None for all) into the
    expert axis: dequantised from packed FP4 + ue8m0 scales, or taken from a dequantised layout's f32."""
    pick = (lambda a: a) if index is None else (lambda a: a[index])
    if "scale" in p:
        return dequant_fp4_weight(pick(p["weight"]), pick(p["scale"]))
    return pick(p["weight"])


# ------------------------------------------------------------ row-invariant f32 sums and products
# A row's (token's) result must not depend on how many rows share the call: speculative decoding
# verifies K drafted tokens in one [B, K+1] step and must reproduce one-token [B, 1] steps exactly,
# and a prompt must compute the same whether it comes as one chunk or page by page (the notebook API
# vs the server). XLA:CPU breaks that in three places (measured on jax 0.10.2,
# tests/ced_jax/test_invariance.py):
# - a dot with a single row (or column) runs as a matrix-vector product, whose summation order differs
#   from the matrix-matrix product of two rows or more (all row counts >= 2 agree with each other);
# - a reduce's order depends on its fusion and on the number of rows (e.g. a 1024-wide row sum
#   differs between 1-3 rows and 4+ rows, a 256-wide one when fused with its consumer);
# - once a fusion holding a reduce is large enough, XLA:CPU hands the whole fusion to YNNPACK (the
#   default `xla_cpu_experimental_ynn_fusion_type` includes reduce fusions), which evaluates the fused
#   elementwise ops with its own exp (and sums in its own order): the Sinkhorn row softmax of
#   `ced_jax.model.layers.mhc.hc_mixes`, exp(c - max(c)) over [T, 4, 4], changes in the last ulp from T = 256
#   rows on. Which fusion goes to YNNPACK depends on its size, hence on B and T.
# So the model's f32 contractions go through `matmul_rows` (at least two rows), its long sums
# through `sum_last` (a `matmul_rows` against ones: sequential f32 accumulation, exact products) and
# its short sums through `sum_small` (explicit left-to-right adds); its maxima whose result feeds
# inexact math (exp) are explicit (`max_small`) or a reduce fenced off from its neighbours
# (`max_fenced`). Each is one f32 order of operations per row, whatever the row count: the
# reference's numerics up to f32 summation order, as before.


def matmul_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] times w [N, K]^T in f32 (HIGHEST), every row's result independent of the
    number of rows: a lone row is padded with a zero row so the product is never a matrix-vector one."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    flat = x.reshape(rows, k)
    if rows == 1:
        flat = jnp.pad(flat, ((0, 1), (0, 0)))
    contract_k = (((1,), (1,)), ((), ()))
    y = jax.lax.dot_general(flat, w, contract_k, precision=jax.lax.Precision.HIGHEST)
    return y[:rows].reshape(*lead, w.shape[0])


def sum_last(x: jax.Array) -> jax.Array:
    """f32 sum over the last axis (kept, size 1), in index order for every row whatever their number.

    Two columns of ones: a one-column product would be a matrix-vector product again."""
    return matmul_rows(x, jnp.ones((2, x.shape[-1]), x.dtype))[..., :1]


def sum_small(x: jax.Array, axis: int) -> jax.Array:
    """f32 sum over a short axis (streams, experts of a token) as explicit left-to-right adds, so no
    reduce emitter picks the order. The axis is dropped."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def sum_axis(x: jax.Array, axis: int) -> jax.Array:
    """f32 sum over `axis` (dropped) in one order per row: `sum_small` for up to 16 terms, else
    `sum_last` with the axis moved last."""
    if x.shape[axis] <= 16:
        return sum_small(x, axis)
    return sum_last(jnp.moveaxis(x, axis, -1))[..., 0]


def max_small(x: jax.Array, axis: int) -> jax.Array:
    """Maximum over a short axis as explicit pairwise maxima: no reduce, so nothing around it can
    land in a YNNPACK reduce fusion (see above). The axis is dropped."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = jnp.maximum(total, part)
    return total


def max_fenced(x: jax.Array, axis: int) -> jax.Array:
    """Maximum over `axis` (dropped) as a reduce alone in its fusion: optimization barriers on its
    operand and result keep the producers and consumers (an exp) out of it, so none of them is
    evaluated by YNNPACK when XLA:CPU hands the reduce to it (see above). A maximum is exact in any
    order, so the reduce alone gives every row the same result whatever the row count."""
    x = jax.lax.optimization_barrier(x)
    return jax.lax.optimization_barrier(jnp.max(x, axis=axis))


def max_axis(x: jax.Array, axis: int) -> jax.Array:
    """`max_small` for up to 16 entries, else `max_fenced`."""
    return max_small(x, axis) if x.shape[axis] <= 16 else max_fenced(x, axis)


def mean_last(x: jax.Array) -> jax.Array:
    """torch's mean over the last axis: an f32 sum (`sum_last`) divided (exactly) by the count."""
    return exact_div(sum_last(x), float(x.shape[-1]))


def pow2_reciprocal(scale: jax.Array) -> jax.Array:
    """1/scale for a power-of-two f32 scale, by negating the exponent bits.

    XLA rewrites x / broadcast(s) as x * (1/s); computing the exact reciprocal ourselves keeps
    the quotient exact for power-of-two scales."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
    return jax.lax.bitcast_convert_type((254 << 23) - bits, jnp.float32)


def fp8_quantize(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """Per-row FP8 activation quantisation: (e4m3 values as f32 [..., K/block, block], scales [..., K/block]).

    Scale = 2^ceil(log2(amax/448)) with amax floored at 1e-4, as the reference's act_quant."""
    xg = split_blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), 1e-4)
    scale = pow2_scale_ceil(amax, _FP8_MAX_INV)
    return round_e4m3(xg * pow2_reciprocal(scale)[..., None]), scale


def fp8_fake_quant(x: jax.Array, block: int = 32) -> jax.Array:
    """FP8 quantise-dequantise along the last axis (values as the reference feeds its GEMMs)."""
    q, scale = fp8_quantize(x, block)
    return (q * scale[..., None]).reshape(x.shape)


def fp4_fake_quant_ue8m0(x: jax.Array, block: int = 32) -> jax.Array:
    """FP4 with power-of-two scales per `block` (indexer q and k). amax floored at 6*2^-126."""
    xg = split_blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), FP4_MAX * 2.0**-126)
    scale = pow2_scale_ceil(amax, _FP4_MAX_INV)
    return (e2m1_to_f32(e2m1_codes_scaled(xg, scale)) * scale[..., None]).reshape(x.shape)


def fp4_fake_quant_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """FP4 with e4m3 scales = RNE(amax/6) per `block` (compressed KV). amax floored at 6*2^-9."""
    xg = split_blocks(x, block)
    scale = fp4_e4m3_block_scale(jnp.max(jnp.abs(xg), axis=-1))
    return (e2m1_to_f32(e2m1_codes_scaled(xg, scale)) * scale[..., None]).reshape(x.shape)
