"""The mHC Sinkhorn against a sequential float32 reference, and its program size."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from ced_jax.model.layers.mhc import sinkhorn
from pallas_kernels.formats import exact_div

EPS = np.float32(1e-6)


def _sequential_sinkhorn(comb: np.ndarray, iters: int) -> np.ndarray:
    """What torch computes: sums in index order, every quotient rounded to f32 on its own."""

    def rows(c):
        total = c[..., 0]
        for k in range(1, c.shape[-1]):
            total = total + c[..., k]
        return total[..., None]

    def cols(c):
        total = c[..., 0, :]
        for j in range(1, c.shape[-2]):
            total = total + c[..., j, :]
        return total[..., None, :]

    c = comb / rows(comb) + EPS
    c = c / (cols(c) + EPS)
    for _ in range(iters - 1):
        c = c / (rows(c) + EPS)
        c = c / (cols(c) + EPS)
    return c


def test_a_quotient_divided_again_is_rounded_twice():
    rng = np.random.default_rng(0)
    a, b, c = (rng.random((4096,), np.float32) + 0.5 for _ in range(3))
    got = np.asarray(jax.jit(lambda a, b, c: exact_div(exact_div(a, b), c))(a, b, c))
    np.testing.assert_array_equal(got, (a / b) / c)
    # XLA's own rewrite, a / (b * c), rounds once less: the data tells the two apart.
    assert np.mean(got != a / (b * c)) > 0.1


@pytest.mark.parametrize("lead", [(1, 1), (3, 5), (2, 300)])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_sinkhorn_is_the_sequential_reference_bit_for_bit(lead, iters):
    rng = np.random.default_rng(iters)
    comb = np.exp(rng.normal(size=(*lead, 4, 4)).astype(np.float32))
    got = np.asarray(jax.jit(lambda c: sinkhorn(c, iters=iters, eps=float(EPS)))(comb))
    np.testing.assert_array_equal(got, _sequential_sinkhorn(comb, iters))


def _compiled_instructions(iters: int) -> int:
    x = jax.ShapeDtypeStruct((2, 7, 4, 4), np.float32)
    text = jax.jit(lambda c: sinkhorn(c, iters=iters, eps=1e-6)).lower(x).compile().as_text()
    return len(re.findall(r"^\s+\S+ = ", text, flags=re.M))


def test_the_compiled_sinkhorn_does_not_grow_with_its_iterations():
    assert _compiled_instructions(20) == _compiled_instructions(3)
