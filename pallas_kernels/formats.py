"""The FP8 / FP4 formats of V4.1 and every codec for them, in JAX and in numpy: the one home of the
byte layouts, shared by the model's fake quantisers (`ced_jax.quant`), the KV cache, the kernels, the
checkpoint loader, the converter and the random-weight generator. A leaf module: jax, numpy and
ml_dtypes only.

Element formats:
- e4m3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff
  are NaN; largest 448, subnormals on a 2^-9 grid below 2^-6.
- e2m1 (FP4): a 4-bit code, bit 3 the sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 by the low 3 bits;
  code 8 ("-0") reads as +0. Two codes per byte, the even index in the low nibble.
- ue8m0: a scale byte e meaning 2^(e - 127); 255 is NaN. Byte 0 (2^-127, an f32 subnormal that
  XLA:CPU and the TPU flush) reads as 0 everywhere, the numpy decoders included; nothing here
  produces it, and no checkpoint scale is that small.

Packed KV entries (uint8, one row per entry; `unpack_*` reads the head dim off the byte width):
- FP8 SWA entry, `fp8_entry_bytes(D)` = D + D/32 (528 B for D = 512): D e4m3 bytes, then D/32
  ue8m0 scales (one per 32 values). `pack_fp8_entries` / `unpack_fp8_entries`.
- FP4 main entry, `fp4_entry_bytes(D)` = D/2 + D/16 (288 B for D = 512): D e2m1 codes, then D/16
  e4m3 scales (one per 16). `pack_fp4_entries` / `unpack_fp4_entries`.
- FP4 index key, `index_key_bytes(Dk)` = Dk/2 + Dk/32 (68 B for Dk = 128): e2m1 codes, then Dk/32
  ue8m0 scales (one per 32). `pack_index_keys` / `unpack_index_keys`.
`pack_*` takes the values the model's matching fake quantiser produced (`ced_jax.quant`:
`fp8_fake_quant`, `fp4_fake_quant_e4m3`, `fp4_fake_quant_ue8m0`) and `unpack_*` gives them back bit
for bit. The stored scale need not be the quantiser's own (a block whose largest code is below the
maximum admits several), only one that represents every value of the block exactly. A block the
format cannot hold exactly is rounded (see each `pack_*`), so callers that must not round compare
`unpack(pack(x))` with x. One exception to bit for bit, a platform artefact: an index-key block at
the floor scale 2^-126 whose code -0.5 gave an f32 subnormal that XLA:CPU flushed to -0 comes back
+0 (FP4 has no -0).

Stored weights: FP8 e4m3 [out, in] with ue8m0 per block_rows x block (B x B in the backbone, 1 x B
for Engram tables): `dequant_fp8_weight`; FP4 experts, codes uint8 [..., N, K/2] with ue8m0 per 32
[..., N, K/32]: `dequant_fp4_weight` / `pack_fp4_weight`. The `np_*` functions are the numpy
counterparts for host code (checkpoint loading, conversion, weight generation); they agree with the
JAX ones bit for bit except where a product is an f32 subnormal (a scale below 2^-117), which XLA
flushes to zero and numpy keeps, and in the sign of NaNs.

Decoders come in two formulations on purpose:
- `decode_*` work on int32 with shifts, masks and bitcasts only, so kernels call them inside Pallas
  bodies (a table gather is not a vector op on TPU);
- `*_to_f32` / `unpack_*` use float8 casts and lookup tables (the references and the model), a
  second formulation, so a kernel and its reference do not share a decoding bug.

Every dequantised value is exactly representable in bf16 (an e4m3 or e2m1 value times a power of
two, or an e2m1 value times an e4m3 scale: at most 6 significant bits), so kernels may feed them to
bf16 matrix units with f32 accumulation and still form every product exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes by 3-bit code; codes 8..15 are the negatives (code 8, -0, reads as +0).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
FP4_TABLE[8] = 0.0
# Both e2m1 values of every packed byte: row b is (FP4_TABLE[b & 15], FP4_TABLE[b >> 4]). One gather
# of a value pair per byte is about twice as fast on XLA:CPU as two nibble gathers and an interleave,
# and reads the same table entries.
FP4_BYTE_PAIRS = np.stack([FP4_TABLE[np.arange(256) & 15], FP4_TABLE[np.arange(256) >> 4]], axis=-1)
# Rounding midpoints between consecutive e2m1 magnitudes; an exact tie goes to the even code, which
# rounds up only at 0.75, 1.75 and 3.5.
_E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])
# The smallest e4m3 value, 2^-9: the floor of an FP4 main entry's scale.
_E4M3_MIN = 2.0**-9


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
    """e2m1 codes held in int32 (0..15, bit 3 = sign) -> f32 (exponent bias 1, one mantissa bit).
    Code 8 gives -0 here, not the tables' +0: the same value in every product and sum."""
    e = (c >> 1) & 3
    m = c & 1
    normal = _f32(((e + 126) << 23) | (m << 22))
    value = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(0.5), normal)
    return jnp.where(((c >> 3) & 1) == 1, -value, value)


def decode_ue8m0(e: jax.Array) -> jax.Array:
    """ue8m0 scale bytes held in int32 -> f32 2^(e-127); 255 is NaN and 0 reads as 0 (the bit
    pattern 0 << 23 is +0)."""
    value = _f32(e << 23)
    return jnp.where(e == 255, jnp.float32(jnp.nan), value)


# ------------------------------------------------------------------------------- rounding
def round_bf16(x: jax.Array) -> jax.Array:
    """Round f32 to the nearest bf16 (ties to even), kept in f32, on the bit pattern.

    A rounding point of the model's numerics. Done with integer ops rather than an f32->bf16->f32
    cast pair because XLA may drop such a pair as 'excess precision' inside a fusion (it does in
    interpret mode), silently skipping the rounding."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    lsb = (bits >> 16) & 1
    return _f32((bits + 0x7FFF + lsb) & -65536)


def round_e4m3(x: jax.Array) -> jax.Array:
    """Nearest e4m3fn value (ties to even), saturating at +-448, kept in f32.

    Arithmetic on the f32 bit pattern (3 mantissa bits; subnormals below 2^-6 on a 2^-9 grid), for
    the same reason as `round_bf16`: a cast pair could be elided by XLA."""
    x = jnp.clip(jnp.asarray(x, jnp.float32), -FP8_MAX, FP8_MAX)
    mag = jnp.abs(x)
    bits = jax.lax.bitcast_convert_type(mag, jnp.int32)
    lsb = (bits >> 20) & 1
    normal = _f32((bits + 0x7FFFF + lsb) & ~0xFFFFF)
    subnormal = jnp.round(mag * 512.0) * np.float32(1.0 / 512.0)
    return jnp.where(jnp.signbit(x), -1.0, 1.0) * jnp.where(mag < 2.0**-6, subnormal, normal)


def exact_div(x: jax.Array, y: jax.Array | float) -> jax.Array:
    """Correctly rounded x / y in f32, as torch computes it.

    XLA rewrites division by a constant or a broadcast divisor into a multiply by the reciprocal,
    which is off by an ulp in ~1/4 of cases and moves FP8/FP4 rounding ties. Giving the divisor
    x's full shape through a data dependency keeps a true division. XLA also rewrites a quotient
    divided again, (a / b) / c, as a / (b * c) (one rounding fewer, another result): the numerator
    passes through a no-op reduce_precision, which XLA keeps and which is not a divide."""
    x = jax.lax.reduce_precision(jnp.asarray(x, jnp.float32), exponent_bits=8, mantissa_bits=23)
    return x / (jnp.zeros_like(x) * x + y)


# ------------------------------------------------------------- table-based element codecs
def e4m3_to_f32(b: jax.Array) -> jax.Array:
    """e4m3fn bytes (any integer dtype) -> f32, through XLA's float8 conversion."""
    return jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def e4m3_bytes(x: jax.Array) -> jax.Array:
    """f32 values exactly representable in e4m3fn -> their bytes (the conversion is exact)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


def ue8m0_to_f32(e: jax.Array) -> jax.Array:
    """ue8m0 scale bytes (any integer dtype) -> f32 2^(e-127); 255 is NaN, 0 reads as 0.

    Built from the bits: the byte is the f32 exponent field of its power of two (0 gives +0.0, and
    255's infinity gets a quiet-NaN mantissa bit). An `ldexp` per element cost more than the matmul
    it fed on XLA:CPU."""
    e = e.astype(jnp.int32) & 0xFF
    return jax.lax.bitcast_convert_type((e << 23) | ((e == 255).astype(jnp.int32) << 22), jnp.float32)


def e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """e2m1 codes (0..15, any integer dtype) -> f32, by table."""
    return jnp.asarray(FP4_TABLE)[codes.astype(jnp.int32)]


def unpack_fp4_values(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] (even index in the low nibble) -> f32 e2m1 values [..., K]."""
    pairs = jnp.asarray(FP4_BYTE_PAIRS)[packed.astype(jnp.int32)]  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# The KV entries are read whole on every step, so their readers use the formulations measured fastest
# inside XLA:CPU's fusions (BENCHMARKS.md, "Stop 47"): one table gather per nibble (about 3x the
# byte-pair gather of `unpack_fp4_values`) and an e4m3 table (about 3x the float8 conversion). Same
# values as `unpack_fp4_values` / `e4m3_to_f32`, NaN bytes included (the table is ml_dtypes').
_E4M3_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _e4m3_by_table(b: jax.Array) -> jax.Array:
    return jnp.asarray(_E4M3_TABLE)[b.astype(jnp.int32)]


def _unpack_fp4_nibbles(packed: jax.Array) -> jax.Array:
    table = jnp.asarray(FP4_TABLE)
    lo = table[(packed & 0x0F).astype(jnp.int32)]
    hi = table[(packed >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_codes_scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
    """uint8 e2m1 codes (bit 3 = sign) of x / scale per block, x [..., n, b] and scale [..., n]:
    round to nearest, ties to the even code, saturating at 6.

    Compares |x| with midpoint * scale instead of dividing: those products are exact, and for bf16
    inputs the comparison gives exactly what the reference's rounded quotient gives, whereas XLA's
    division (a reciprocal multiply) can move a tie."""
    mag = jnp.abs(x)[..., None]
    mids = jnp.asarray(_E2M1_MIDS) * scale[..., None, None]
    code = jnp.sum(mag > mids, axis=-1) + jnp.sum((mag == mids) & _E2M1_TIE_UP, axis=-1)
    return code.astype(jnp.uint8) | (jnp.signbit(x).astype(jnp.uint8) << 3)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., K] -> [..., K/2], the even index in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def split_blocks(x: jax.Array, block: int) -> jax.Array:
    """f32 [..., K] -> [..., K/block, block]; ValueError unless block divides K."""
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return jnp.asarray(x, jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _scaled(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., K] times scales [..., K/b], each scale over its block of b values."""
    v = values.reshape(*scales.shape, values.shape[-1] // scales.shape[-1])
    return (v * scales[..., None]).reshape(values.shape)


def _pow2(e: jax.Array) -> jax.Array:
    """int32 exponents in [-126, 127] -> f32 2^e, built from the bits (exact)."""
    return _f32((e + 127) << 23)


def _min_pow2_exponent(amax: jax.Array, max_value: float) -> jax.Array:
    """Smallest e with amax <= max_value * 2^e, by exponent and mantissa bits (a float quotient could
    round across a power of two); 0 where amax == 0. Clamped to [-126, 127] so the scale byte stays
    a normal power of two: a fake-quantised block never needs more (its own scale is such a power of
    two and at least this large), other blocks below 2^-117 lose precision."""
    max_bits = int(np.float32(max_value).view(np.int32))
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    e = ((bits >> 23) & 0xFF) - ((max_bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) > (max_bits & 0x7FFFFF))
    return jnp.clip(jnp.where(amax > 0, e, 0), -126, 127).astype(jnp.int32)


def _check_entry_dim(x: jax.Array, what: str) -> None:
    if x.ndim < 1 or x.shape[-1] % 32:
        raise ValueError(f"{what}: the head dim (last axis of {list(x.shape)}) must be a multiple of 32")


# ------------------------------------------------------------------------ KV entry codecs
def pack_fp8_entries(x: jax.Array) -> jax.Array:
    """f32 [..., D] -> FP8 entries uint8 [..., D + D/32].

    Scale: the smallest power of two s with amax / s <= 448 per 32 values. For `fp8_fake_quant`
    values this is lossless (signed zeros and e4m3 subnormals included): their own scale is a power
    of two at least that large, and an e4m3 value times 2^k stays e4m3 while it is <= 448. Other
    values are rounded to nearest e4m3 at that scale."""
    _check_entry_dim(x, "pack_fp8_entries")
    xb = split_blocks(x, 32)
    e = _min_pow2_exponent(jnp.max(jnp.abs(xb), axis=-1), FP8_MAX)
    q = round_e4m3(xb * _pow2(-e)[..., None])  # multiplying by a power of two is exact
    return jnp.concatenate([e4m3_bytes(q).reshape(x.shape), (e + 127).astype(jnp.uint8)], axis=-1)


def unpack_fp8_entries(entries: jax.Array) -> jax.Array:
    """uint8 [..., D + D/32] -> f32 [..., D]."""
    dim = dim_of_entry(entries.shape[-1], "fp8")
    return _scaled(_e4m3_by_table(entries[..., :dim]), ue8m0_to_f32(entries[..., dim:]))


def fp4_e4m3_block_scale(amax: jax.Array) -> jax.Array:
    """The e4m3 scale the model gives an FP4 main-entry block: RNE(amax / 6), amax floored at
    6 * 2^-9 so the scale is at least the smallest e4m3 value (an all-zero block included)."""
    amax = jnp.maximum(amax, FP4_MAX * _E4M3_MIN)
    return round_e4m3(exact_div(amax, FP4_MAX))


def pack_fp4_entries(x: jax.Array) -> jax.Array:
    """f32 [..., D] -> FP4 main entries uint8 [..., D/2 + D/16] (e4m3 scale per 16).

    A block of `fp4_fake_quant_e4m3` values is c_i * s with e2m1 c_i and an e4m3 s. Its largest
    |c_i| is one of the seven nonzero e2m1 magnitudes, so s = amax / c for some c: try c from 6 down
    and keep the first quotient that is an e4m3 value and reproduces every value of the block (the
    quantiser's own scale is among them), so the block is stored exactly. A block with no such
    scale is quantised as the model does (`fp4_e4m3_block_scale`, codes to nearest even), so that
    `unpack_fp4_entries(pack_fp4_entries(x))` is `fp4_fake_quant_e4m3(x)` for such x."""
    _check_entry_dim(x, "pack_fp4_entries")
    xb = split_blocks(x, 16)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    chosen = fp4_e4m3_block_scale(amax)
    found = jnp.zeros(amax.shape, bool)
    for c in (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5):
        s = exact_div(amax, c)
        exact = jnp.all(e2m1_to_f32(e2m1_codes_scaled(xb, s)) * s[..., None] == xb, axis=-1)
        ok = (round_e4m3(s) == s) & (s > 0) & exact & ~found
        chosen = jnp.where(ok, s, chosen)
        found = found | ok
    codes = e2m1_codes_scaled(xb, chosen).reshape(x.shape)
    return jnp.concatenate([pack_nibbles(codes), e4m3_bytes(chosen)], axis=-1)


def unpack_fp4_entries(entries: jax.Array) -> jax.Array:
    """uint8 [..., D/2 + D/16] -> f32 [..., D]."""
    dim = dim_of_entry(entries.shape[-1], "fp4")
    return _scaled(_unpack_fp4_nibbles(entries[..., : dim // 2]), _e4m3_by_table(entries[..., dim // 2 :]))


def _pack_fp4_pow2(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 [..., K] -> (codes uint8 [..., K/2], ue8m0 bytes [..., K/32]), scale the smallest power of
    two with amax / s <= 6 per 32 values."""
    xb = split_blocks(x, 32)
    e = _min_pow2_exponent(jnp.max(jnp.abs(xb), axis=-1), FP4_MAX)
    codes = e2m1_codes_scaled(xb, _pow2(e)).reshape(x.shape)
    return pack_nibbles(codes), (e + 127).astype(jnp.uint8)


def pack_index_keys(x: jax.Array) -> jax.Array:
    """f32 [..., Dk] -> FP4 index keys uint8 [..., Dk/2 + Dk/32] (ue8m0 scale per 32).

    Scale: the smallest power of two s with amax / s <= 6. For `fp4_fake_quant_ue8m0` values this is
    lossless: their own scale is a power of two at least that large, and an e2m1 value times 2^k
    stays e2m1 while it is <= 6. Other values are rounded to nearest even e2m1 at that scale."""
    _check_entry_dim(x, "pack_index_keys")
    codes, scales = _pack_fp4_pow2(x)
    return jnp.concatenate([codes, scales], axis=-1)


def unpack_index_keys(entries: jax.Array) -> jax.Array:
    """uint8 [..., Dk/2 + Dk/32] -> f32 [..., Dk]."""
    dim = dim_of_entry(entries.shape[-1], "index")
    return _scaled(_unpack_fp4_nibbles(entries[..., : dim // 2]), ue8m0_to_f32(entries[..., dim // 2 :]))


# ---------------------------------------------------------------------------- stored weights
def _fp8_scale_factors(scale, out_dim: int, in_dim: int, block: int, block_rows: int, xp):
    """ue8m0 scale grid [..., ceil(out/block_rows), ceil(in/block)] -> per-element f32 factors."""
    want = (-(-out_dim // block_rows), -(-in_dim // block))
    if tuple(scale.shape[-2:]) != want:
        raise ValueError(
            f"scale must be [..., {want[0]}, {want[1]}] for an FP8 weight [..., {out_dim}, {in_dim}] "
            f"with {block_rows} x {block} blocks, got {list(scale.shape)}"
        )
    f = ue8m0_to_f32(scale) if xp is jnp else np_ue8m0_to_f32(scale)
    f = xp.repeat(xp.repeat(f, block_rows, axis=-2)[..., :out_dim, :], block, axis=-1)
    return f[..., :in_dim]


def dequant_fp8_weight(
    weight: jax.Array, scale: jax.Array, block: int = 32, block_rows: int | None = None
) -> jax.Array:
    """FP8 e4m3 [..., out, in] with ue8m0 [..., ceil(out/block_rows), ceil(in/block)] -> f32.
    block_rows defaults to block (B x B blocks); Engram tables use 1."""
    out_dim, in_dim = weight.shape[-2:]
    f = _fp8_scale_factors(scale, out_dim, in_dim, block, block_rows or block, jnp)
    return weight.astype(jnp.float32) * f


def _check_fp4_weight(packed_shape, scale_shape) -> None:
    if tuple(scale_shape[:-1]) != tuple(packed_shape[:-1]) or scale_shape[-1] * 16 != packed_shape[-1]:
        raise ValueError(
            f"scale must be [..., N, K/32] for FP4 codes [..., N, K/2] = {list(packed_shape)}, "
            f"got {list(scale_shape)}"
        )


def dequant_fp4_weight(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """FP4 expert weights, codes uint8 [..., N, K/2] with ue8m0 [..., N, K/32] -> f32 [..., N, K]."""
    _check_fp4_weight(packed.shape, scale.shape)
    return _scaled(unpack_fp4_values(packed), ue8m0_to_f32(scale))


def pack_fp4_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 weights [..., N, K] -> (codes uint8 [..., N, K/2], ue8m0 scales uint8 [..., N, K/32]),
    scale the smallest power of two with amax / s <= 6 per 32 (lossless on values already FP4 with
    power-of-two scales per 32)."""
    return _pack_fp4_pow2(w)


# --------------------------------------------------------------------- numpy (host) codecs
def np_ue8m0_to_f32(e: np.ndarray) -> np.ndarray:
    """ue8m0 bytes -> f32 2^(e-127); 255 is NaN, 0 reads as 0 (as `ue8m0_to_f32`)."""
    e = np.asarray(e).astype(np.int32)
    f = np.ldexp(np.float32(1.0), np.where(e == 255, 0, e) - 127).astype(np.float32)  # 2^128 overflows
    f[e == 0] = 0.0
    f[e == 255] = np.nan
    return f


def np_ue8m0_byte_ceil(x: np.ndarray) -> np.ndarray:
    """Positive normal f32 x -> the ue8m0 byte of the smallest power of two >= x, read from the bits
    (exact, unlike ceil(log2(x)) in floating point): the exponent field, +1 if any mantissa bit."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    exponent = (bits >> 23) & 0xFF
    if not np.all((exponent > 0) & (exponent < 254) & (bits >> 31 == 0)):
        raise ValueError("ue8m0 scale input must be a positive normal f32 below 2^127")
    return (exponent + ((bits & 0x7FFFFF) != 0)).astype(np.uint8)


def np_e2m1_codes(v: np.ndarray) -> np.ndarray:
    """f32 -> uint8 e2m1 codes: nearest magnitude, ties to the even code, saturating at 6; bit 3 is
    the sign bit (so small negatives and -0 give code 8)."""
    mag = np.abs(v)
    lo = np.searchsorted(_E2M1_MIDS, mag, side="left")  # midpoints strictly below
    hi = np.searchsorted(_E2M1_MIDS, mag, side="right")  # ... or equal
    # On a midpoint between codes lo and lo + 1, take the even one.
    code = np.where(hi != lo, lo + (lo & 1), lo).astype(np.uint8)
    return code | (np.signbit(v).astype(np.uint8) << 3)


def np_pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., K] -> [..., K/2], the even index in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def np_dequant_fp8_weight(
    weight: np.ndarray, scale: np.ndarray, block: int, block_rows: int | None = None
) -> np.ndarray:
    """FP8 e4m3 [..., out, in] with ue8m0 bytes [..., ceil(out/block_rows), ceil(in/block)] -> f32.

    block_rows defaults to block (B x B blocks, as DeepSeek's convert.py dequantises wo_a); Engram
    tables use 1. Each product is exact in f32 (and in bf16: 4 significant bits times a power of two)."""
    out_dim, in_dim = weight.shape[-2:]
    f = _fp8_scale_factors(scale, out_dim, in_dim, block, block_rows or block, np)
    return weight.astype(np.float32) * f


def np_dequant_fp4_weight(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP4 codes uint8 [..., N, K/2] with ue8m0 bytes [..., N, K/32] -> f32 [..., N, K]."""
    _check_fp4_weight(packed.shape, scale.shape)
    values = FP4_BYTE_PAIRS[packed].reshape(*scale.shape, 32)
    return (values * np_ue8m0_to_f32(scale)[..., None]).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
