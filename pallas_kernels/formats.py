"""Byte formats of the packed KV caches and FP4 expert weights, and their codecs.

Formats (all little-endian byte arrays, `uint8`):
- FP8 SWA entry, `fp8_entry_bytes(D)` = D + D/32 (528 B for D = 512): D e4m3fn bytes, then D/32
  ue8m0 scale bytes (one per 32 values).
- FP4 main entry, `fp4_entry_bytes(D)` = D/2 + D/16 (288 B for D = 512): D e2m1 codes two per byte
  (even index in the low nibble), then D/16 e4m3fn scale bytes (one per 16 values).
- FP4 index key, `index_key_bytes(Dk)` = Dk/2 + Dk/32 (68 B for Dk = 128): e2m1 codes as above, then
  Dk/32 ue8m0 scale bytes (one per 32 values).
- FP4 expert weight: codes uint8 [E, N, K/2] as above plus ue8m0 scales uint8 [E, N, K/32].
ue8m0 byte e means 2^(e - 127) (255 is NaN); e2m1 code 8 (-0) reads as +0.

Two families of functions live here:
- `decode_*` / `round_bf16` work on int32 / f32 arrays with shifts, masks and bitcasts only, so the
  kernels call them inside Pallas bodies (no table lookups: a gather is not a vector op on TPU);
- `unpack_*` (table lookups, used by the references: a second formulation, so kernel and reference
  do not share a decoding bug) and `pack_*` (quantisers, used by tests and by the model adapter).

Every dequantised value is exactly representable in bf16 (an e4m3 or e2m1 value times a power of
two, or an e2m1 value times an e4m3 scale: at most 6 significant bits), so kernels may feed them to
bf16 matrix units with f32 accumulation and still form every product exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes by 3-bit code; codes 8..15 are the negatives (code 8, -0, reads as +0).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_TABLE = np.concatenate([_E2M1, -_E2M1]).astype(np.float32)
FP4_TABLE[8] = 0.0
# Rounding midpoints between consecutive e2m1 magnitudes; an exact tie goes to the even code,
# which rounds up only at 0.75, 1.75 and 3.5.
_E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])


# ---------------------------------------------------------------------------------- sizes
def fp8_entry_bytes(dim: int) -> int:
    return dim + dim // 32


def fp4_entry_bytes(dim: int) -> int:
    return dim // 2 + dim // 16


def index_key_bytes(dim: int) -> int:
    return dim // 2 + dim // 32


def dim_of_entry(nbytes: int, fmt: str) -> int:
    """Head dim of an entry of `nbytes` in format `fmt` ('fp8', 'fp4', 'index'); raises if none fits."""
    per_32 = {"fp8": 33, "fp4": 18, "index": 17}[fmt]  # bytes per 32 values
    if nbytes % per_32:
        raise ValueError(
            f"{nbytes}-byte entries are not a {fmt} format (a multiple of {per_32} B per 32 values)"
        )
    return nbytes // per_32 * 32


# ------------------------------------------------------------------ in-kernel bit decoders
def _f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def decode_e4m3(b: jax.Array) -> jax.Array:
    """e4m3fn bytes held in int32 (0..255) -> f32. Normals get their f32 bit pattern directly;
    subnormals (exponent field 0) are m * 2^-9; 0x7f / 0xff are NaN."""
    e = (b >> 3) & 15
    m = b & 7
    normal = _f32(((e + 120) << 23) | (m << 20))
    value = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(2.0**-9), normal)
    value = jnp.where((e == 15) & (m == 7), jnp.float32(jnp.nan), value)
    return jnp.where(((b >> 7) & 1) == 1, -value, value)


def decode_e2m1(c: jax.Array) -> jax.Array:
    """e2m1 codes held in int32 (0..15, bit 3 = sign) -> f32 (exponent bias 1, one mantissa bit)."""
    e = (c >> 1) & 3
    m = c & 1
    normal = _f32(((e + 126) << 23) | (m << 22))
    value = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(0.5), normal)
    return jnp.where(((c >> 3) & 1) == 1, -value, value)


def decode_ue8m0(e: jax.Array) -> jax.Array:
    """ue8m0 scale bytes held in int32 -> f32 2^(e-127); 255 is NaN, and 0 (2^-127, a subnormal that
    XLA:CPU and the TPU flush anyway) reads as 0 everywhere, references included."""
    value = _f32(e << 23)
    return jnp.where(e == 255, jnp.float32(jnp.nan), value)


def round_bf16(x: jax.Array) -> jax.Array:
    """Round f32 to the nearest bf16 (ties to even), kept in f32, on the bit pattern.

    A rounding point of the model's numerics. Done with integer ops rather than an f32->bf16->f32
    cast pair because XLA may drop such a pair inside a fusion (it does in interpret mode)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    lsb = (bits >> 16) & 1
    return _f32((bits + 0x7FFF + lsb) & -65536)


# ---------------------------------------------------------------- table-based unpacking
def _nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> int32 codes [..., K] in natural order (even index from the low nibble)."""
    p = packed.astype(jnp.int32)
    return jnp.stack([p & 15, p >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _fp4_values(packed: jax.Array) -> jax.Array:
    return jnp.asarray(FP4_TABLE)[_nibbles(packed)]


def _e4m3_values(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def _ue8m0_values(e: jax.Array) -> jax.Array:
    e = e.astype(jnp.int32)
    value = jnp.where(e == 0, 0.0, jnp.ldexp(jnp.float32(1.0), e - 127))
    return jnp.where(e == 255, jnp.nan, value)


def _scaled(values: jax.Array, scales: jax.Array) -> jax.Array:
    block = values.shape[-1] // scales.shape[-1]
    v = values.reshape(*scales.shape, block)
    return (v * scales[..., None]).reshape(values.shape)


def unpack_fp8_entries(entries: jax.Array) -> jax.Array:
    """uint8 [..., D + D/32] -> f32 [..., D]."""
    dim = dim_of_entry(entries.shape[-1], "fp8")
    return _scaled(_e4m3_values(entries[..., :dim]), _ue8m0_values(entries[..., dim:]))


def unpack_fp4_entries(entries: jax.Array) -> jax.Array:
    """uint8 [..., D/2 + D/16] -> f32 [..., D]."""
    dim = dim_of_entry(entries.shape[-1], "fp4")
    return _scaled(_fp4_values(entries[..., : dim // 2]), _e4m3_values(entries[..., dim // 2 :]))


def unpack_index_keys(entries: jax.Array) -> jax.Array:
    """uint8 [..., Dk/2 + Dk/32] -> f32 [..., Dk]."""
    dim = dim_of_entry(entries.shape[-1], "index")
    return _scaled(_fp4_values(entries[..., : dim // 2]), _ue8m0_values(entries[..., dim // 2 :]))


def dequant_fp4_weight(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """Expert weights uint8 [..., N, K/2] with ue8m0 [..., N, K/32] -> f32 [..., N, K]."""
    return _scaled(_fp4_values(packed), _ue8m0_values(scale))


# ------------------------------------------------------------------------------ packing
def round_e4m3(x: jax.Array) -> jax.Array:
    """Nearest e4m3fn value (ties to even), saturating at +-448, kept in f32 (bit arithmetic)."""
    x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    mag = jnp.abs(x)
    bits = jax.lax.bitcast_convert_type(mag, jnp.int32)
    lsb = (bits >> 20) & 1
    normal = _f32((bits + 0x7FFFF + lsb) & ~0xFFFFF)
    subnormal = jnp.round(mag * 512.0) * np.float32(1.0 / 512.0)
    return jnp.where(jnp.signbit(x), -1.0, 1.0) * jnp.where(mag < 2.0**-6, subnormal, normal)


def _e4m3_bytes(x: jax.Array) -> jax.Array:
    """f32 values exactly representable in e4m3fn -> their bytes (the conversion is exact)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


def _e2m1_codes(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Codes of x / scale per block (x [..., n, b], scale [..., n]), by comparing |x| with
    midpoint * scale (exact products) instead of dividing (XLA's division is a reciprocal multiply)."""
    mag = jnp.abs(x)[..., None]
    mids = jnp.asarray(_E2M1_MIDS) * scale[..., None, None]
    code = jnp.sum(mag > mids, axis=-1) + jnp.sum((mag == mids) & _E2M1_TIE_UP, axis=-1)
    return code.astype(jnp.uint8) | (jnp.signbit(x).astype(jnp.uint8) << 3)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _min_pow2_exponent(amax: jax.Array, max_value: float) -> jax.Array:
    """Smallest e with amax <= max_value * 2^e, by exponent and mantissa bits (a float quotient could
    round across a power of two). 0 where amax == 0."""
    max_bits = int(np.float32(max_value).view(np.int32))
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    e = ((bits >> 23) & 0xFF) - ((max_bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) > (max_bits & 0x7FFFFF))
    # Clamped so the scale byte stays a normal power of two (blocks below 2^-119 lose precision).
    return jnp.clip(jnp.where(amax > 0, e, 0), -126, 127).astype(jnp.int32)


def _pow2(e: jax.Array) -> jax.Array:
    return _f32((e + 127) << 23)


def pack_fp8_entries(x: jax.Array) -> jax.Array:
    """f32 [..., D] -> FP8 entries uint8 [..., D + D/32], scale = smallest power of two with
    amax / s <= 448. For values already FP8-fake-quantised (ue8m0, 32) this is lossless: their own
    scale is a power of two at least as large, and e4m3 values times 2^k stay e4m3 up to 448."""
    xb = _blocks(x, 32)
    e = _min_pow2_exponent(jnp.max(jnp.abs(xb), axis=-1), FP8_MAX)
    q = round_e4m3(xb * _pow2(-e)[..., None])  # multiplying by a power of two is exact
    return jnp.concatenate([_e4m3_bytes(q).reshape(x.shape), (e + 127).astype(jnp.uint8)], axis=-1)


def _pack_fp4_pow2(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    xb = _blocks(x, 32)
    e = _min_pow2_exponent(jnp.max(jnp.abs(xb), axis=-1), FP4_MAX)
    codes = _e2m1_codes(xb, _pow2(e)).reshape(x.shape)
    return _pack_nibbles(codes), (e + 127).astype(jnp.uint8)


def pack_index_keys(x: jax.Array) -> jax.Array:
    """f32 [..., Dk] -> FP4 index keys uint8 [..., Dk/2 + Dk/32] (ue8m0 scales per 32, the smallest
    power of two with amax / s <= 6: lossless for values already FP4-fake-quantised that way)."""
    codes, scales = _pack_fp4_pow2(x)
    return jnp.concatenate([codes, scales], axis=-1)


def pack_fp4_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 weights [..., N, K] -> (codes uint8 [..., N, K/2], ue8m0 scales uint8 [..., N, K/32])."""
    return _pack_fp4_pow2(w)


def quantize_fp4_entries(x: jax.Array) -> jax.Array:
    """f32 [..., D] -> FP4 main entries uint8 [..., D/2 + D/16] as the model quantises them:
    e4m3 scale = RNE(amax / 6) per 16 (amax floored at 6 * 2^-9), codes round to nearest even."""
    xb = _blocks(x, 16)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), FP4_MAX * 2.0**-9)
    scale = round_e4m3(amax / (jnp.zeros_like(amax) * amax + FP4_MAX))  # a true division, see _e2m1_codes
    codes = _e2m1_codes(xb, scale).reshape(x.shape)
    return jnp.concatenate([_pack_nibbles(codes), _e4m3_bytes(scale)], axis=-1)


def repack_fp4_entries(x: jax.Array) -> jax.Array:
    """FP4 main-entry values that are already on the grid (c_i * s, e2m1 c_i, e4m3 s per 16) ->
    uint8 entries that decode to exactly those values.

    The block's largest |c_i| is one of the seven e2m1 magnitudes, so s = amax / c for some c: try
    them from 6 down and keep the first e4m3 scale that reproduces every value. A block with no such
    scale (values that were never FP4-quantised) gets a NaN scale byte, so the error is loud."""
    xb = _blocks(x, 16)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    table = jnp.asarray(FP4_TABLE)
    chosen = jnp.full_like(amax, jnp.nan)
    found = amax == 0
    chosen = jnp.where(found, 1.0, chosen)  # all-zero block: any scale, codes 0
    for c in (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5):
        # Rounding to e4m3 absorbs the last-ulp error of the reciprocal multiply XLA emits.
        s = round_e4m3(amax * np.float32(1.0 / c))
        codes = _e2m1_codes(xb, s)
        exact = jnp.all(table[codes.astype(jnp.int32)] * s[..., None] == xb, axis=-1)
        ok = exact & (s > 0) & ~found
        chosen = jnp.where(ok, s, chosen)
        found = found | ok
    codes = _e2m1_codes(xb, jnp.where(jnp.isnan(chosen), 1.0, chosen)).reshape(x.shape)
    scale_bytes = jnp.where(jnp.isnan(chosen), jnp.uint8(0x7F), _e4m3_bytes(jnp.nan_to_num(chosen)))
    return jnp.concatenate([_pack_nibbles(codes), scale_bytes], axis=-1)
