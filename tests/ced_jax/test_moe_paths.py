"""The routed-expert fast paths: FP4 weight decoding and the one-expert-at-a-time loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.model.layers import kernels, moe
from ced_jax.quant import dequant_fp4_weight, fp8_fake_quant, round_bf16


def _e2m1(code: int) -> float:
    """e2m1 by its definition: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; -0 reads +0."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude if magnitude else 0.0


def test_fp4_dequant_is_the_format_bit_for_bit():
    packed = np.tile(np.arange(256, dtype=np.uint8), (4, 2))  # every byte, 4 rows, in = 1024
    # Scales whose products stay normal f32 (XLA:CPU flushes subnormal results to zero).
    exponents = np.array([[2], [100], [127], [200]], np.uint8).repeat(packed.shape[1] * 2 // 32, axis=1)
    got = np.asarray(jax.jit(dequant_fp4_weight)(packed, exponents))
    values = np.array([[_e2m1(b & 15), _e2m1(b >> 4)] for b in range(256)], np.float32)
    scale = np.ldexp(np.float32(1), exponents.astype(np.int32) - 127).astype(np.float32)
    want = values[packed].reshape(4, -1) * np.repeat(scale, 32, axis=1)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def _gathered_rows(rows, eids, weights, experts, limit):
    """The per-row gather path (kernels.expert_matmul with fewer rows than experts)."""
    gate = round_bf16(kernels.expert_matmul(rows, eids, experts["w1"]))
    up = round_bf16(kernels.expert_matmul(rows, eids, experts["w3"]))
    hidden = round_bf16(weights[:, None] * moe.swiglu(gate, up, limit))
    return round_bf16(kernels.expert_matmul(fp8_fake_quant(hidden), eids, experts["w2"]))


@pytest.mark.parametrize("tile", [1, 3, 32])
def test_expert_loop_matches_the_gather_path(tile):
    """Same products per row; only a GEMM's summation order may differ, which can move a bf16
    rounding of the output by one unit. Experts chosen by several rows and unused experts occur."""
    rng = np.random.default_rng(0)
    num_experts, d, f, n = 16, 64, 32, 12

    def stack(out_dim, in_dim):
        return {
            "weight": rng.integers(0, 256, (num_experts, out_dim, in_dim // 2), dtype=np.uint8),
            "scale": rng.integers(120, 128, (num_experts, out_dim, in_dim // 32), dtype=np.uint8),
        }

    experts = {"w1": stack(f, d), "w3": stack(f, d), "w2": stack(d, f)}
    rows = np.asarray(fp8_fake_quant(jnp.asarray(rng.standard_normal((n, d)), jnp.float32)))
    eids = rng.choice(num_experts // 2, n).astype(np.int32)  # repeats, and half the experts unused
    weights = rng.random(n).astype(np.float32)
    loop = jax.jit(lambda *a: moe._expert_rows_by_expert(*a, limit=10.0, tile=tile))
    got = np.asarray(loop(rows, eids, weights, experts))
    want = np.asarray(jax.jit(lambda *a: _gathered_rows(*a, 10.0))(rows, eids, weights, experts))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=0)
    assert np.mean(got == want) > 0.95


@pytest.mark.parametrize("entries", [5, kernels.EXPERT_DECODE_GROUP, 12, 2 * kernels.EXPERT_DECODE_GROUP + 1])
def test_decode_entries_in_groups_equal_each_entry_alone(entries):
    """A decode step's (row, expert) entries are dequantised a group at a time (a loop over groups
    past kernels.EXPERT_DECODE_GROUP): every entry's product is bit for bit what it is alone."""
    rng = np.random.default_rng(1)
    num_experts, n, k = 32, 48, 64
    w = {
        "weight": jnp.asarray(rng.integers(0, 256, (num_experts, n, k // 2), dtype=np.uint8)),
        "scale": jnp.asarray(rng.integers(120, 128, (num_experts, n, k // 32), dtype=np.uint8)),
    }
    rows = fp8_fake_quant(jnp.asarray(rng.standard_normal((entries, k)), jnp.float32))
    eids = jnp.asarray(rng.integers(0, num_experts, entries).astype(np.int32))
    matmul = jax.jit(kernels.expert_matmul)
    got = np.asarray(matmul(rows, eids, w))
    assert got.shape == (entries, n) and np.abs(got).max() > 0
    for i in range(entries):
        alone = np.asarray(matmul(rows[i : i + 1], eids[i : i + 1], w))[0]
        assert np.array_equal(got[i].view(np.uint32), alone.view(np.uint32)), i
