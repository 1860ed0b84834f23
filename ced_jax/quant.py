"""FP8 / FP4 storage formats and the fake quantisation that is part of V4.1's semantics.

Conventions
- Activations travel as float32 arrays whose values are exactly representable in bfloat16
  (`round_bf16` marks every point where DeepSeek's reference rounds to bf16). XLA:CPU runs f32
  far faster than bf16, and the values (hence the numerics) are the same.
- FP8 is e4m3fn; scales are ue8m0 (a power of two) stored as the raw exponent byte (uint8,
  value 2^(e-127)). FP4 is e2m1, two codes per byte, the even index in the low nibble.
- Fake quantisation returns the dequantised values (what the reference writes back in place),
  so every downstream GEMM is exact over dequantised products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
# The reference multiplies by the reciprocal as an fp32 constant before rounding the scale up.
_FP8_MAX_INV = np.float32(1.0 / FP8_MAX)
_FP4_MAX_INV = np.float32(1.0 / FP4_MAX)
# E2M1 magnitudes by 3-bit code; codes 8..15 are the negatives (code 8 is -0, read as +0).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP4_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
FP4_TABLE[8] = 0.0
# Midpoints between consecutive magnitudes; at an exact tie the even code wins, which rounds up
# only at 0.75, 1.75 and 3.5.
_E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])


def round_bf16(x: jax.Array) -> jax.Array:
    """Round to the nearest bf16 value (ties to even), kept in f32: a reference bf16 rounding point.

    Done on the bit pattern rather than as an f32->bf16->f32 cast pair, because XLA may drop such
    a pair as 'excess precision' inside fusions, silently skipping the rounding."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    lsb = (bits >> 16) & 1
    rounded = (bits + jnp.uint32(0x7FFF) + lsb) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32)


def pow2_scale_ceil(amax: jax.Array, max_inv: np.float32) -> jax.Array:
    """2^ceil(log2(amax * max_inv)) by exponent bits: the ue8m0 'fast round scale'."""
    x = amax.astype(jnp.float32) * max_inv
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa_nonzero = (bits & 0x7FFFFF) != 0
    log2_ceil = exponent - 127 + mantissa_nonzero.astype(jnp.int32)
    return jax.lax.bitcast_convert_type((log2_ceil + 127) << 23, jnp.float32)


def exact_div(x: jax.Array, y: jax.Array | float) -> jax.Array:
    """Correctly rounded x / y, as torch computes it.

    XLA rewrites division by a constant or a broadcast divisor into a multiply by the reciprocal,
    which is off by an ulp in ~1/4 of cases and moves FP8/FP4 rounding ties. Giving the divisor
    the full shape through a data dependency keeps a true division."""
    x = jnp.asarray(x, jnp.float32)
    return x / (jnp.zeros_like(x) * x + y)


def mean_last(x: jax.Array) -> jax.Array:
    """torch's mean over the last axis: an f32 sum divided (exactly) by the count."""
    return exact_div(jnp.sum(x, axis=-1, keepdims=True), float(x.shape[-1]))


def pow2_reciprocal(scale: jax.Array) -> jax.Array:
    """1/scale for a power-of-two f32 scale, by negating the exponent bits.

    XLA rewrites x / broadcast(s) as x * (1/s); computing the exact reciprocal ourselves keeps
    the quotient exact for power-of-two scales."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
    return jax.lax.bitcast_convert_type((254 << 23) - bits, jnp.float32)


def round_e4m3(x: jax.Array) -> jax.Array:
    """Round to the nearest e4m3fn value (ties to even), saturating at +-448, kept in f32.

    Arithmetic on the f32 bit pattern (3 mantissa bits; subnormals below 2^-6 on a 2^-9 grid),
    for the same reason as `round_bf16`: a cast pair could be elided by XLA."""
    x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    mag = jnp.abs(x)
    bits = jax.lax.bitcast_convert_type(mag, jnp.uint32)
    lsb = (bits >> 20) & 1
    normal = jax.lax.bitcast_convert_type(
        (bits + jnp.uint32(0x7FFFF) + lsb) & jnp.uint32(0xFFF00000), jnp.float32
    )
    subnormal = jnp.round(mag * 512.0) * np.float32(1.0 / 512.0)
    return jnp.where(jnp.signbit(x), -1.0, 1.0) * jnp.where(mag < 2.0**-6, subnormal, normal)


def e2m1_codes_scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
    """e2m1 codes (bit 3 = sign) of x / scale, round to nearest, ties to even, saturating at 6.

    Compares |x| with midpoint * scale instead of dividing: those products are exact, and for
    bf16 inputs the comparison gives exactly what the reference's rounded quotient gives, whereas
    XLA's division (a reciprocal multiply) can move a tie."""
    mag = jnp.abs(x)[..., None]
    mids = jnp.asarray(_E2M1_MIDS) * scale[..., None, None]
    code = jnp.sum(mag > mids, axis=-1) + jnp.sum((mag == mids) & _E2M1_TIE_UP, axis=-1)
    return code.astype(jnp.uint8) | (jnp.signbit(x).astype(jnp.uint8) << 3)


def _fp4_dequant_codes(codes: jax.Array) -> jax.Array:
    return jnp.asarray(FP4_TABLE)[codes.astype(jnp.int32)]


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_quantize(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """Per-row FP8 activation quantisation: (e4m3 values as f32 [..., K/block, block], scales [..., K/block]).

    Scale = 2^ceil(log2(amax/448)) with amax floored at 1e-4, as the reference's act_quant."""
    xg = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), 1e-4)
    scale = pow2_scale_ceil(amax, _FP8_MAX_INV)
    return round_e4m3(xg * pow2_reciprocal(scale)[..., None]), scale


def fp8_fake_quant(x: jax.Array, block: int = 32) -> jax.Array:
    """FP8 quantise-dequantise along the last axis (values as the reference feeds its GEMMs)."""
    q, scale = fp8_quantize(x, block)
    return (q * scale[..., None]).reshape(x.shape)


def fp4_fake_quant_ue8m0(x: jax.Array, block: int = 32) -> jax.Array:
    """FP4 with power-of-two scales per `block` (indexer q and k). amax floored at 6*2^-126."""
    xg = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), FP4_MAX * 2.0**-126)
    scale = pow2_scale_ceil(amax, _FP4_MAX_INV)
    return (_fp4_dequant_codes(e2m1_codes_scaled(xg, scale)) * scale[..., None]).reshape(x.shape)


def fp4_fake_quant_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """FP4 with e4m3 scales = RNE(amax/6) per `block` (compressed KV). amax floored at 6*2^-9."""
    xg = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), FP4_MAX * 2.0**-9)
    scale = round_e4m3(exact_div(amax, FP4_MAX))
    return (_fp4_dequant_codes(e2m1_codes_scaled(xg, scale)) * scale[..., None]).reshape(x.shape)


# ---------------------------------------------------------------------------- stored weights
def e8m0_to_f32(exponent_bytes: jax.Array) -> jax.Array:
    """ue8m0 scale bytes -> f32 2^(e-127). (255 is NaN in the format; checkpoints do not use it.)"""
    e = exponent_bytes.astype(jnp.int32)
    return jnp.where(e == 255, jnp.nan, jnp.ldexp(jnp.float32(1.0), e - 127))


def dequant_fp8_weight(weight: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """FP8 [out, in] (+ leading axes) with ue8m0 [ceil(out/B), ceil(in/B)] block scales -> f32."""
    out_dim, in_dim = weight.shape[-2:]
    s = e8m0_to_f32(scale)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2)[..., :out_dim, :], block, axis=-1)[..., :in_dim]
    return weight.astype(jnp.float32) * s


# Both e2m1 values of every packed byte: row b is (FP4_TABLE[b & 15], FP4_TABLE[b >> 4]). One
# gather of a value pair per byte is about twice as fast on XLA:CPU as two nibble gathers and an
# interleave, and reads the same table entries (bit for bit).
FP4_BYTE_PAIRS = np.stack([FP4_TABLE[np.arange(256) & 15], FP4_TABLE[np.arange(256) >> 4]], axis=-1)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] (low nibble = even index) -> f32 e2m1 values [..., K]."""
    pairs = jnp.asarray(FP4_BYTE_PAIRS)[packed.astype(jnp.int32)]  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequant_fp4_weight(packed: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """FP4 [..., out, in/2] with ue8m0 [..., out, in/32] scales -> f32 [..., out, in]."""
    values = unpack_fp4(packed)
    return values * jnp.repeat(e8m0_to_f32(scale), block, axis=-1)


# ---------------------------------------------------------------------------- host-side helpers
def np_bf16(x: np.ndarray) -> np.ndarray:
    """Host bf16 rounding (RNE), returned as f32."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
