"""The codecs of `pallas_kernels.formats`, each against an independent authority: ml_dtypes' e4m3 /
e2m1 / e8m0 types and numpy's correctly rounded division for the element codecs, the model's fake
quantisers (`ced_jax.quant`) for the KV entry formats (pack, then unpack, gives their values back bit
for bit), and the numpy weight dequantisers against the JAX ones and against ml_dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ced_jax.quant import fp4_fake_quant_e4m3, fp4_fake_quant_ue8m0, fp8_fake_quant
from pallas_kernels import formats

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
)
ROWS, DIM = 4, 64  # one shape for every example, so each jitted function compiles once
ALL_BYTES = np.arange(256, dtype=np.uint8)


def bits(a) -> np.ndarray:
    """f32 values -> their bit patterns, so comparisons tell -0 from +0; every NaN maps to one
    pattern (XLA and numpy give NaNs different signs)."""
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


def e8m0_reference(byte: np.ndarray) -> np.ndarray:
    return byte.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


# ------------------------------------------------------------------------- element codecs
def test_bit_decoders_and_table_decoders_match_ml_dtypes():
    b = jnp.arange(256, dtype=jnp.int32)
    e4m3 = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert (bits(formats.decode_e4m3(b)) == bits(e4m3)).all()
    assert (bits(formats.e4m3_to_f32(b)) == bits(e4m3)).all()
    # e2m1: ml_dtypes reads code 8 as -0; the format (DeepSeek's table) reads it as +0.
    e2m1 = ALL_BYTES[:16].view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    e2m1[8] = 0.0
    np.testing.assert_array_equal(formats.decode_e2m1(jnp.arange(16)), e2m1)  # its code 8 is -0
    assert (bits(formats.e2m1_to_f32(jnp.arange(16))) == bits(e2m1)).all()
    assert (bits(formats.FP4_TABLE) == bits(e2m1)).all()
    # ue8m0: ml_dtypes for 1..255 (255 is NaN); byte 0 (2^-127, which XLA flushes) reads as +0 in
    # every decoder, the numpy one included.
    e8m0 = e8m0_reference(ALL_BYTES)
    e8m0[0] = 0.0
    for decoded in (formats.decode_ue8m0(b), formats.ue8m0_to_f32(b), formats.np_ue8m0_to_f32(ALL_BYTES)):
        assert (bits(decoded) == bits(e8m0)).all()


def test_unpack_fp4_values_is_nibble_order():
    packed = ALL_BYTES.reshape(4, 64)
    want = formats.FP4_TABLE[np.stack([packed & 15, packed >> 4], axis=-1).reshape(4, 128)]
    assert (bits(formats.unpack_fp4_values(jnp.asarray(packed))) == bits(want)).all()


def test_round_bf16_and_e4m3_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-20, 12, 4096))).astype(np.float32)
    x = np.concatenate([x, [0.0, -0.0, 448.0, 464.0, -1e6, 2.0**-10, -(2.0**-10), 2.0**-7 * 1.0625]])
    x = x.astype(np.float32)
    assert (bits(formats.round_bf16(x)) == bits(x.astype(ml_dtypes.bfloat16).astype(np.float32))).all()
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert (bits(formats.round_e4m3(x)) == bits(want)).all()


def test_exact_div_is_correctly_rounded_with_a_broadcast_divisor():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    y = (rng.standard_normal((64, 1)) + 3.0).astype(np.float32)
    # Under jit with a broadcast divisor, a plain x / y becomes a reciprocal multiply.
    got = jax.jit(formats.exact_div)(x, y)
    assert (bits(got) == bits(x / y)).all()  # numpy's f32 division is IEEE, correctly rounded
    assert (bits(jax.jit(formats.exact_div)(x, 3.0)) == bits(x / np.float32(3.0))).all()


def test_e2m1_encoders_agree_with_ml_dtypes_and_each_other():
    rng = np.random.default_rng(3)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    v = np.concatenate(
        [rng.uniform(-6, 6, 20_000), mids, -mids, formats.E2M1_VALUES, -formats.E2M1_VALUES, [7.0, -100.0]]
    ).astype(np.float32)
    np_codes = formats.np_e2m1_codes(v)
    in_range = np.abs(v) <= 6  # ml_dtypes does not saturate; both encoders do (to code 7 / 15)
    want = v[in_range].astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np_codes[in_range], want)
    assert np_codes[-2:].tolist() == [7, 15]
    jax_codes = formats.e2m1_codes_scaled(jnp.asarray(v)[None, :], jnp.ones(1))[0]
    np.testing.assert_array_equal(np.asarray(jax_codes), np_codes)
    codes = rng.integers(0, 16, (8, 64), dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(formats.pack_nibbles(jnp.asarray(codes))), formats.np_pack_nibbles(codes)
    )


def test_ue8m0_byte_ceil():
    x = np.array([1.0, 1.0000001, 0.75, 2.0**-126, 448.0 / 448.0, 3.0 * 2.0**100], np.float32)
    assert formats.np_ue8m0_byte_ceil(x).tolist() == [127, 128, 127, 1, 127, 229]
    for bad in (0.0, -1.0, 2.0**127, 2.0**-130):
        with pytest.raises(ValueError, match="positive normal f32"):
            formats.np_ue8m0_byte_ceil(np.array([bad], np.float32))


# ------------------------------------------------------------------------------- sizes
def test_entry_sizes():
    sizes = (formats.fp8_entry_bytes(512), formats.fp4_entry_bytes(512), formats.index_key_bytes(128))
    assert sizes == (528, 288, 68)
    assert formats.dim_of_entry(528, "fp8") == 512 and formats.dim_of_entry(288, "fp4") == 512
    assert formats.dim_of_entry(68, "index") == 128
    with pytest.raises(ValueError):
        formats.dim_of_entry(300, "fp4")


# ---------------------------------------------------------------------- KV entry codecs
FORMATS = {
    # name: (fake quantiser, pack, unpack, bytes per entry of DIM values)
    "fp8": (fp8_fake_quant, formats.pack_fp8_entries, formats.unpack_fp8_entries, formats.fp8_entry_bytes),
    "fp4": (
        fp4_fake_quant_e4m3,
        formats.pack_fp4_entries,
        formats.unpack_fp4_entries,
        formats.fp4_entry_bytes,
    ),
    "index": (
        fp4_fake_quant_ue8m0,
        formats.pack_index_keys,
        formats.unpack_index_keys,
        formats.index_key_bytes,
    ),
}


def _round_trip(quantise, pack, unpack):
    @jax.jit
    def run(x):
        q = quantise(x)
        packed = pack(q)
        return q, packed, unpack(packed)

    return run


ROUND_TRIPS = {name: _round_trip(q, p, u) for name, (q, p, u, _) in FORMATS.items()}


@st.composite
def structured_values(draw) -> np.ndarray:
    """f32 [ROWS, DIM] built from blocks of 16: per block a kind and a binary exponent from subnormal
    scales (2^-140) to huge (2^120), so the 32-value blocks mix magnitudes (e4m3 subnormals inside
    an FP8 block), with zeros, negative zeros and single nonzeros."""
    n = ROWS * DIM // 16
    kinds = draw(
        st.lists(st.sampled_from(["normal", "zeros", "neg_zeros", "one", "sparse"]), min_size=n, max_size=n)
    )
    exps = draw(st.lists(st.integers(-140, 120), min_size=n, max_size=n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((n, 16)) * np.exp2(np.array(exps, np.float64))[:, None]
    for i, kind in enumerate(kinds):
        if kind == "zeros":
            x[i] = 0.0
        elif kind == "neg_zeros":
            x[i] = -0.0
        elif kind == "one":
            x[i, 1:] = 0.0
        elif kind == "sparse":
            x[i, rng.random(16) < 0.6] = -0.0
    return x.astype(np.float32).reshape(ROWS, DIM)


FINITE_F32 = arrays(
    np.float32, (ROWS, DIM), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)
)


def check_round_trips(x: np.ndarray) -> None:
    for name, run in ROUND_TRIPS.items():
        q, packed, back = (np.asarray(a) for a in run(jnp.asarray(x)))
        assert packed.dtype == np.uint8 and packed.shape == (ROWS, FORMATS[name][3](DIM)), name
        same = bits(back) == bits(q)
        if name == "index":
            # At the floor scale 2^-126 a code +-0.5 gives an f32 subnormal, which XLA:CPU flushes to
            # a signed zero; FP4 has no -0 (code 8 reads +0), so such a -0 comes back +0.
            same |= (bits(q) == 0x80000000) & (bits(back) == 0)
        assert same.all(), (name, x[~same.all(axis=-1)], q[~same], back[~same])


@PROPERTY
@given(structured_values())
def test_pack_unpack_gives_fake_quantised_values_back(x):
    check_round_trips(x)


@PROPERTY
@given(FINITE_F32)
def test_pack_unpack_gives_fake_quantised_values_back_any_f32(x):
    check_round_trips(x)


def test_round_trip_edge_blocks():
    """Fixed cases the properties may or may not draw: e4m3-subnormal FP4 scales (blocks below
    6 * 2^-6), e4m3 subnormals inside FP8 blocks, blocks at the smallest ue8m0 scales, saturation."""
    x = np.zeros((ROWS, DIM), np.float32)
    x[0, :16] = np.linspace(-1e-3, 1e-3, 16)  # FP4 scale ~ 2^-13: an e4m3 subnormal
    x[0, 16:32] = -0.0
    x[0, 32:64] = np.float32(2.0**-30) * np.arange(32)  # tiny next to ...
    x[0, 63] = 1000.0  # ... a large value: e4m3 subnormals / zeros in the FP8 block
    x[1, :32] = np.float32(2.0**-125) * np.arange(1, 33)  # near the smallest ue8m0 scales
    x[1, 32:] = np.float32(3e38) * np.sign(np.arange(32) - 15.5)  # huge: FP4-e4m3 scales saturate at 448
    x[2] = np.float32(6.0) * np.exp2(np.arange(DIM) % 7 - 3)
    x[3, :32] = -np.float32(2.0**-140)  # f32 subnormals
    x[3, 32:] = np.float32(2.0**-126)  # index keys at the floor scale: an e2m1 1.0 at 2^-126
    check_round_trips(x)


E4M3_VALUES = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E4M3_FINITE = E4M3_VALUES[np.isfinite(E4M3_VALUES)]


@st.composite
def representable_blocks(draw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values each format holds exactly but that its fake quantiser did not make, e.g. a block whose
    largest e2m1 code is 4 or 1.5, so the pack must find a scale other than the quantiser's rule:
    (FP8 [ROWS, DIM], FP4 main [ROWS, DIM], FP4 index [ROWS, DIM])."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7]))  # the largest e2m1 magnitude code in a block
    codes = rng.integers(0, top + 1, (ROWS, DIM)) | (rng.integers(0, 2, (ROWS, DIM)) << 3)
    e2m1 = formats.FP4_TABLE[codes]
    e4m3_scales = rng.choice(E4M3_FINITE[E4M3_FINITE > 0], (ROWS, DIM // 16))
    fp4 = e2m1 * np.repeat(e4m3_scales, 16, axis=-1)
    # Power-of-two scales down to where the smallest nonzero value (e2m1 0.5, e4m3 2^-9) is still a
    # normal f32: XLA:CPU flushes f32 subnormals, so no quantiser output is one.
    pow2 = np.exp2(rng.integers(-117, 80, (ROWS, DIM // 32)))
    index = e2m1 * np.repeat(pow2 * np.exp2(rng.integers(-8, 40, (ROWS, 1))), 32, axis=-1)
    fp8 = rng.choice(E4M3_FINITE, (ROWS, DIM)) * np.repeat(pow2, 32, axis=-1)
    return fp8.astype(np.float32), fp4.astype(np.float32), index.astype(np.float32)


PACK_UNPACK = {
    name: jax.jit(lambda x, pack=pack, unpack=unpack: unpack(pack(x)))
    for name, (_, pack, unpack, _) in FORMATS.items()
}


@PROPERTY
@given(representable_blocks())
def test_pack_stores_every_representable_block_exactly(blocks):
    for name, x in zip(("fp8", "fp4", "index"), blocks, strict=True):
        back = np.asarray(PACK_UNPACK[name](jnp.asarray(x)))
        assert (bits(back) == bits(x)).all(), (name, x[bits(back) != bits(x)], back[bits(back) != bits(x)])


def test_pack_fp4_entries_quantises_other_values_as_the_model_does():
    """Values never quantised have no exact FP4 block scale; pack_fp4_entries rounds them exactly as
    `fp4_fake_quant_e4m3` does (so it also serves as the packing quantiser for raw keys)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 128)).astype(np.float32) * np.exp2(rng.integers(-10, 10, (32, 1)))
    got = jax.jit(lambda v: formats.unpack_fp4_entries(formats.pack_fp4_entries(v)))(x)
    assert (bits(got) == bits(fp4_fake_quant_e4m3(jnp.asarray(x)))).all()


def test_pack_rejects_dims_the_format_cannot_hold():
    for pack in (formats.pack_fp8_entries, formats.pack_fp4_entries, formats.pack_index_keys):
        with pytest.raises(ValueError, match="multiple of 32"):
            pack(jnp.zeros((2, 48)))


# ---------------------------------------------------------------------------- weights
def _fp8_weight_case(out_dim: int, in_dim: int, block: int, block_rows: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (out_dim, in_dim), dtype=np.uint8)
    w[0, :] = np.resize(ALL_BYTES, in_dim)  # every e4m3 byte (NaNs and -0 too)
    w[:, 0] = np.resize(ALL_BYTES, out_dim)
    grid = (-(-out_dim // block_rows), -(-in_dim // block))
    scale = rng.integers(0, 256, grid, dtype=np.uint8)
    scale.flat[:4] = [0, 1, 255, 127]
    return w.view(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize(("out_dim", "in_dim", "block", "block_rows"), [(96, 100, 32, 32), (70, 64, 32, 1)])
def test_fp8_weight_dequant_numpy_jax_ml_dtypes(out_dim, in_dim, block, block_rows):
    w, scale = _fp8_weight_case(out_dim, in_dim, block, block_rows, seed=out_dim)
    got_np = formats.np_dequant_fp8_weight(w, scale, block, block_rows=block_rows)
    got_jax = np.asarray(
        jax.jit(formats.dequant_fp8_weight, static_argnums=(2, 3))(
            jnp.asarray(w), jnp.asarray(scale), block, block_rows
        )
    )
    full = np.repeat(np.repeat(scale, block_rows, axis=0), block, axis=1)[:out_dim, :in_dim]
    with np.errstate(invalid="ignore"):
        ref = w.astype(np.float32) * e8m0_reference(full)  # ml_dtypes' decoding of both factors
    byte0 = full == 0
    assert (bits(got_np[~byte0]) == bits(ref[~byte0])).all()
    # Byte 0 reads as 0: the product is a zero (or NaN for a NaN weight) of the weight's sign.
    with np.errstate(invalid="ignore"):
        zeros = w.astype(np.float32)[byte0] * np.float32(0.0)
    assert (bits(got_np[byte0]) == bits(zeros)).all()
    # JAX agrees bit for bit except on f32 subnormal products, which XLA flushes to zero.
    subnormal = (np.abs(got_np) < np.finfo(np.float32).tiny) & (got_np != 0)
    assert (bits(got_jax[~subnormal]) == bits(got_np[~subnormal])).all()
    assert (got_jax[subnormal] == 0).all()


def test_fp8_weight_dequant_rejects_a_mismatched_scale_grid():
    w = np.zeros((64, 64), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale must be"):
        formats.np_dequant_fp8_weight(w, np.zeros((3, 2), np.uint8), 32)
    with pytest.raises(ValueError, match="scale must be"):
        formats.dequant_fp8_weight(jnp.asarray(w), jnp.zeros((2, 2), jnp.uint8), 32, block_rows=1)


def test_fp4_weight_dequant_numpy_jax_ml_dtypes():
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (3, 256, 64), dtype=np.uint8)
    packed[0, 0, :] = np.resize(ALL_BYTES, 64)
    packed[0, 1, :] = np.resize(ALL_BYTES[64:], 64)
    scale = rng.integers(0, 256, (3, 256, 4), dtype=np.uint8)
    scale.flat[:4] = [0, 1, 255, 127]
    got_np = formats.np_dequant_fp4_weight(packed, scale)
    got_jax = np.asarray(jax.jit(formats.dequant_fp4_weight)(jnp.asarray(packed), jnp.asarray(scale)))
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(3, 256, 128)
    full = np.repeat(scale, 32, axis=-1)
    with np.errstate(invalid="ignore"):
        ref = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * e8m0_reference(full)
    # Values as ml_dtypes decodes them (== treats its -0 for code 8 as our +0), byte 0 read as 0.
    ref[full == 0] = 0.0
    np.testing.assert_array_equal(got_np, ref)
    assert not np.signbit(got_np[codes == 8]).any()
    subnormal = (np.abs(got_np) < np.finfo(np.float32).tiny) & (got_np != 0)
    assert (bits(got_jax[~subnormal]) == bits(got_np[~subnormal])).all()
    assert (got_jax[subnormal] == 0).all()
    with pytest.raises(ValueError, match="scale must be"):
        formats.np_dequant_fp4_weight(packed, scale[..., :2])


def test_pack_fp4_weight_is_lossless_on_fp4_weights():
    rng = np.random.default_rng(6)
    packed = jnp.asarray(rng.integers(0, 256, (2, 16, 64), dtype=np.uint8))
    scale = jnp.asarray(rng.integers(100, 150, (2, 16, 4), dtype=np.uint8))
    w = formats.dequant_fp4_weight(packed, scale)
    again = formats.dequant_fp4_weight(*formats.pack_fp4_weight(w))
    assert (bits(again) == bits(w)).all()
