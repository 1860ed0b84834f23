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
    "pow2_reciprocal",
    "pow2_scale_ceil",
    "round_bf16",
    "round_e4m3",
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
