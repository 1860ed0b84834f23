"""The mHC Sinkhorn against a sequential float32 reference, and its program size."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from ced_jax.invariant import sum_small
from ced_jax.model.layers.mhc import hc_collapse, hc_expand, sinkhorn
from ced_jax.quant import round_bf16
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


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jax.numpy.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32))


def test_collapse_and_expand_round_each_product_before_the_adds():
    """hc_collapse / hc_expand equal f32 products rounded, then added in stream order (torch's separate
    kernels), at every row count. The control: the same formulas with the products left to XLA are
    contracted into fused multiply-adds in some rows once the fused loop vectorises over enough rows,
    so their result would depend on the row count and on the fusion (PARITY.md, "RMS norms in torch's
    order")."""
    f32 = np.float32
    rng = np.random.default_rng(1)
    rows, width = 512, 256
    x = rng.normal(size=(rows, 4, width)).astype(f32)
    y = rng.normal(size=(rows, width)).astype(f32)
    pre, post = rng.uniform(0, 1, (rows, 4)).astype(f32), rng.uniform(0, 2, (rows, 4)).astype(f32)
    comb = rng.uniform(0, 1, (rows, 4, 4)).astype(f32)

    def in_order(products):  # [rows, 4, ...] summed over axis 1 left to right, each add rounded
        total = products[:, 0]
        for k in range(1, 4):
            total = (total + products[:, k]).astype(f32)
        return total

    want_collapse = _bf16(in_order((pre[..., None] * x).astype(f32)))
    mixed = in_order((comb[..., None] * x[:, :, None, :]).astype(f32))
    want_expand = _bf16(((post[..., None] * y[:, None, :]).astype(f32) + mixed).astype(f32))
    for n in (1, 2, 3, 8, 64, 512):
        got = jax.jit(hc_collapse)(x[:n], pre[:n])
        assert np.array_equal(np.asarray(got), want_collapse[:n]), n
        got = jax.jit(hc_expand)(y[:n], x[:n], post[:n], comb[:n])
        assert np.array_equal(np.asarray(got), want_expand[:n]), n

    def unfenced(y, r, post, comb):
        mixed = sum_small(comb[..., None] * r[..., :, None, :], -3)
        return round_bf16(post[..., None] * y[..., None, :] + mixed)

    assert not np.array_equal(np.asarray(jax.jit(unfenced)(y, x, post, comb)), want_expand)
