"""The byte codecs: in-kernel bit decoders against ml_dtypes / table lookups, and lossless packing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import formats


def test_bit_decoders_match_tables():
    b = jnp.arange(256, dtype=jnp.int32)
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(formats.decode_e4m3(b)), ref)
    np.testing.assert_array_equal(np.asarray(formats.decode_e2m1(jnp.arange(16))), formats.FP4_TABLE)
    np.testing.assert_array_equal(
        np.asarray(formats.decode_ue8m0(b)), np.asarray(formats._ue8m0_values(b.astype(jnp.uint8)))
    )


def test_round_bf16_and_e4m3_match_ml_dtypes():
    x = (np.random.default_rng(0).standard_normal(4096) * 50).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(formats.round_bf16(x)), x.astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(formats.round_e4m3(x)),
        np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
    )


def test_entry_sizes():
    assert (formats.fp8_entry_bytes(512), formats.fp4_entry_bytes(512), formats.index_key_bytes(128)) == (
        528,
        288,
        68,
    )
    assert formats.dim_of_entry(528, "fp8") == 512 and formats.dim_of_entry(288, "fp4") == 512
    with pytest.raises(ValueError):
        formats.dim_of_entry(300, "fp4")


@jax.jit
def _round_trips(x):
    fp8 = formats.unpack_fp8_entries(formats.pack_fp8_entries(x))
    fp4 = formats.unpack_fp4_entries(formats.quantize_fp4_entries(x))
    keys = formats.unpack_index_keys(formats.pack_index_keys(x))
    return {
        "fp8": (fp8, formats.unpack_fp8_entries(formats.pack_fp8_entries(fp8))),
        "fp4": (fp4, formats.unpack_fp4_entries(formats.repack_fp4_entries(fp4))),
        "index": (keys, formats.unpack_index_keys(formats.pack_index_keys(keys))),
        "raw": formats.unpack_fp4_entries(formats.repack_fp4_entries(x)),
    }


def test_packing_is_lossless_on_quantised_values():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 128)).astype(np.float32) * np.exp2(rng.integers(-10, 10, (32, 1)))
    out = _round_trips(jnp.asarray(x))
    for kind in ("fp8", "fp4", "index"):
        np.testing.assert_array_equal(*(np.asarray(a) for a in out[kind]), err_msg=kind)
    # Values never quantised have no exact FP4 scale: the repacker says so with NaN, not silently.
    assert np.isnan(np.asarray(out["raw"])).any()
