"""The CPU kernels (`pallas_kernels._cpu`, built from pallas_kernels/csrc by `pip install`): the FP4
expert product (`grouped_matmul.kernel_cpu`) equals `reference.expert_rows_blocked`, its order stated
in jnp, bit for bit, with the vector and the portable loops; the grouped-matmul contract holds; it is
within the f32 dot's rounding bound of the XLA product (`reference.gmm`), whose order differs; bad ids
and a missing build are one-line errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _cpu, formats
from pallas_kernels.grouped_matmul import kernel_cpu, reference
from tests.pallas_kernels.cases import fp8_activations, gmm_case


def _rows_case(seed, m, k, n, e, spread=4):
    rng = np.random.default_rng(seed)
    rows = fp8_activations(rng, (m, k))
    rows *= np.exp2(rng.integers(-spread, spread, (m, 1))).astype(np.float32)  # rows of other magnitudes
    ids = rng.integers(0, e, m).astype(np.int32)
    packed = rng.integers(0, 256, (e, n, k // 2)).astype(np.uint8)
    scales = rng.integers(127 - 12, 127 + 12, (e, n, k // 32)).astype(np.uint8)
    return [jnp.asarray(a) for a in (rows, ids, packed, scales)]


def test_the_kernels_are_built_here():
    """The test machines have a C++ compiler, so `pip install -e .` built the kernels."""
    assert _cpu.available(), _cpu._load()
    assert _cpu.vector_width() in (0, 256, 512)


@pytest.mark.parametrize("m, k, n, e", [(1, 32, 1, 1), (3, 96, 33, 4), (8, 512, 64, 16), (48, 2048, 40, 64)])
def test_expert_rows_equal_the_blocked_order_bit_for_bit(m, k, n, e):
    args = _rows_case(m * 7 + k, m, k, n, e)
    want = np.asarray(jax.jit(reference.expert_rows_blocked)(*args))
    vector = np.asarray(jax.jit(kernel_cpu.expert_rows)(*args))
    portable = np.asarray(jax.jit(lambda *a: kernel_cpu.expert_rows(*a, portable=True))(*args))
    assert np.isfinite(want).all()
    assert np.array_equal(vector, want)
    assert np.array_equal(portable, want)
    # Each row alone gives its own result: nothing in the order depends on the other rows.
    alone = np.asarray(jax.jit(kernel_cpu.expert_rows)(args[0][-1:], args[1][-1:], *args[2:]))
    assert np.array_equal(alone, want[-1:])


def test_the_blocked_order_is_not_the_xla_products_order():
    """The comparison above can fail: the XLA einsum's f32 order gives other values in many outputs,
    all within its rounding-error bound."""
    rows, ids, packed, scales = _rows_case(5, 16, 2048, 128, 8)
    blocked = np.asarray(jax.jit(kernel_cpu.expert_rows)(rows, ids, packed, scales))
    w = np.asarray(jax.jit(formats.dequant_fp4_weight)(packed[ids], scales[ids]))
    x = np.asarray(rows)
    xla = np.asarray(jax.jit(lambda x, w: jnp.einsum("mk,mnk->mn", x, w, precision="highest"))(x, w))
    assert 0.05 < np.mean(blocked != xla)
    bound = 2 * 2048 * 2.0**-24 * np.einsum("mk,mnk->mn", np.abs(x), np.abs(w))
    assert np.all(np.abs(blocked - xla) <= bound)


@pytest.mark.parametrize("seed, m, k, n, e, fill", [(0, 37, 128, 128, 5, 0.8), (1, 64, 256, 96, 3, 1.0)])
def test_grouped_matmul_contract(seed, m, k, n, e, fill):
    """`kernel_cpu.gmm` on ragged groups with empty (poisoned) experts and NaN rows past the groups:
    those rows are zero, the others within the f32 bound of `reference.gmm`."""
    case = gmm_case(seed, m, k, n, e, fill)
    got = np.asarray(jax.jit(kernel_cpu.gmm)(*case.args()))
    ref = np.asarray(jax.jit(reference.gmm)(*case.args()))
    live = int(case.group_sizes.sum())
    assert not got[live:].any() and np.isfinite(got).all()
    w = np.asarray(jax.jit(formats.dequant_fp4_weight)(case.w_packed, case.w_scale))
    ids = np.repeat(np.arange(e), case.group_sizes)
    bound = 2 * k * 2.0**-24 * np.einsum("mk,mnk->mn", np.abs(case.lhs[:live]), np.abs(w[ids]))
    assert np.all(np.abs(got[:live] - ref[:live]) <= bound)


def test_an_expert_id_out_of_range_is_an_error_naming_the_row():
    rows, ids, packed, scales = _rows_case(3, 4, 64, 8, 3)
    with pytest.raises(Exception, match=r"expert id 7 of row 2 is outside 0\.\.2"):
        jax.block_until_ready(kernel_cpu.expert_rows(rows, ids.at[2].set(7), packed, scales))
    with pytest.raises(ValueError, match=r"expert ids must be int32 \[4\]"):
        kernel_cpu.expert_rows(rows, ids[:3], packed, scales)


def test_without_the_build_the_kernels_say_how_to_get_them(monkeypatch):
    monkeypatch.setattr(_cpu, "library_path", lambda: None)
    _cpu._load.cache_clear()
    try:
        assert not _cpu.available()
        with pytest.raises(_cpu.CpuKernelsUnavailable, match=r"not built .*pip install -e \."):
            kernel_cpu.expert_rows(*_rows_case(3, 2, 32, 4, 2))
    finally:
        monkeypatch.undo()
        _cpu._load.cache_clear()
    assert _cpu.available()
