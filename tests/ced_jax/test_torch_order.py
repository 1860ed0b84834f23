"""`ced_jax.invariant.torch_sum_last` / `torch_mean_last` / `reciprocal_sqrt`: torch's CPU order of the
RMS norms' mean of squares and its rsqrt (tests/golden/PARITY.md, "RMS norms in torch's order").

The order itself was measured against torch 2.13 (not a dependency here); these tests pin what the
functions promise: the documented order (against a numpy evaluation of it, step by step), one result
per row whatever the row count, and that the order is not a plain sequential or pairwise sum (so
the choice matters). `reciprocal_sqrt` inside a compiled program is numpy's 1 / sqrt(x) in f32 (both
correctly rounded), which XLA's rsqrt is not on every input. `rounded_square` keeps the squares out of
the fused multiply-adds that LLVM forms in XLA:CPU's fused loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.invariant import reciprocal_sqrt, rounded_square, torch_mean_last, torch_sum_last

F32 = np.float32


def _documented_order(x: np.ndarray) -> np.ndarray:
    """4 accumulators of 8 lanes over 32 values per step, added in order, then their lanes, then the rest."""
    n = x.shape[-1]
    main = n // 32 * 32
    acc = [np.zeros(x.shape[:-1] + (8,), F32) for _ in range(4)]
    for i in range(0, main, 32):
        for a in range(4):
            acc[a] = (acc[a] + x[..., i + 8 * a : i + 8 * a + 8]).astype(F32)
    lanes = (((acc[0] + acc[1]).astype(F32) + acc[2]).astype(F32) + acc[3]).astype(F32)
    total = lanes[..., 0]
    for j in range(1, 8):
        total = (total + lanes[..., j]).astype(F32)
    for j in range(main, n):
        total = (total + x[..., j]).astype(F32)
    return total


@pytest.mark.parametrize("width", [7, 64, 96, 100, 128, 512])
def test_sum_follows_the_documented_order_in_every_row(width):
    rng = np.random.default_rng(width)
    x = (rng.normal(size=(300, width)) * rng.uniform(0.1, 10, size=(300, 1))).astype(F32)
    got = np.asarray(jax.jit(torch_sum_last)(jnp.asarray(x)))
    assert np.array_equal(got, _documented_order(x))
    alone = np.asarray(jax.jit(torch_sum_last)(jnp.asarray(x[:1])))
    assert np.array_equal(alone, got[:1])  # a lone row: the same order
    mean = np.asarray(jax.jit(torch_mean_last)(jnp.asarray(x)))
    assert mean.shape == (300, 1) and np.array_equal(mean[:, 0], (got / F32(width)).astype(F32))
    if width >= 64:  # the order matters: neither a sequential nor numpy's pairwise sum is it
        sequential = np.zeros(300, F32)
        for j in range(width):
            sequential = (sequential + x[:, j]).astype(F32)
        assert not np.array_equal(got, sequential)
        assert not np.array_equal(got, np.sum(x, axis=-1, dtype=F32))


def test_wider_rows_are_refused_by_the_sum_and_kept_by_the_mean():
    x = jnp.ones((2, 513), jnp.float32)
    with pytest.raises(ValueError, match="513 values, at most 512"):
        torch_sum_last(x)
    assert np.array_equal(np.asarray(torch_mean_last(x)), np.ones((2, 1), F32))


def test_reciprocal_sqrt_is_one_over_a_correctly_rounded_sqrt_when_compiled():
    x = np.random.default_rng(0).uniform(1e-3, 1e4, size=200_000).astype(F32)
    want = (F32(1) / np.sqrt(x)).astype(F32)
    got = np.asarray(jax.jit(lambda v: reciprocal_sqrt(v) * 1.0)(jnp.asarray(x)))
    assert np.array_equal(got, want)
    rsqrt = np.asarray(jax.jit(jax.lax.rsqrt)(jnp.asarray(x)))
    assert not np.array_equal(rsqrt, want)  # what the fence keeps XLA from substituting


def test_rounded_squares_sum_as_rounded_values_in_every_row_count():
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(256, 256)) * 3).astype(F32)
    want = _documented_order((x * x).astype(F32))
    fenced = jax.jit(lambda v: torch_sum_last(rounded_square(v)))
    for rows in (1, 3, 4, 16, 64, 256):
        assert np.array_equal(np.asarray(fenced(jnp.asarray(x[:rows]))), want[:rows]), rows
    # The control: squares fused into the adds are contracted into fused multiply-adds (some rows differ).
    fused = np.asarray(jax.jit(lambda v: torch_sum_last(v * v))(jnp.asarray(x)))
    assert not np.array_equal(fused, want)
    x[3, 5] = np.nan
    assert np.isnan(np.asarray(fenced(jnp.asarray(x)))[3])
