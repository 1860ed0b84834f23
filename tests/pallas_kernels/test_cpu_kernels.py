"""The CPU kernels (`pallas_kernels._cpu`, built from pallas_kernels/csrc by `pip install`): the FP4
expert product (`grouped_matmul.kernel_cpu`) equals `reference.expert_rows_in_run_order` (XLA:CPU's
order of sums stated in numpy, `pallas_kernels.run_order`) bit for bit, with the vector and the
portable loops; the grouped-matmul contract holds; bad ids and a missing build are one-line errors.
The FP8 linear (`fp8_linear.kernel_cpu`) likewise against `fp8_linear.reference.linear_in_run_order`;
the indexer's scores (`indexer.kernel_cpu`) against `indexer.reference.index_scores`. Equality with
the model's XLA path itself: tests/ced_jax/test_cpu_kernels_model.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import _cpu, formats
from pallas_kernels.fp8_linear import kernel_cpu as fp8_kernel
from pallas_kernels.fp8_linear import reference as fp8_reference
from pallas_kernels.grouped_matmul import kernel_cpu, reference
from pallas_kernels.indexer import kernel_cpu as index_kernel
from pallas_kernels.indexer import reference as indexer_reference
from tests.pallas_kernels.cases import fp8_activations, gmm_case, indexer_case


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


# The last case: about 23 rows per expert, so tiles of 16 rows of one expert and their remainders.
@pytest.mark.parametrize(
    "m, k, n, e", [(1, 32, 1, 1), (3, 96, 33, 4), (8, 512, 64, 16), (48, 2048, 40, 64), (70, 256, 72, 3)]
)
def test_expert_rows_equal_the_run_order_bit_for_bit(m, k, n, e):
    args = _rows_case(m * 7 + k, m, k, n, e)
    want = reference.expert_rows_in_run_order(*args)
    vector = np.asarray(jax.jit(kernel_cpu.expert_rows)(*args))
    portable = np.asarray(jax.jit(lambda *a: kernel_cpu.expert_rows(*a, portable=True))(*args))
    assert np.isfinite(want).all()
    assert np.array_equal(vector, want)
    assert np.array_equal(portable, want)
    # Each row alone gives its own result: nothing in the order depends on the other rows.
    alone = np.asarray(jax.jit(kernel_cpu.expert_rows)(args[0][-1:], args[1][-1:], *args[2:]))
    assert np.array_equal(alone, want[-1:])


def test_the_runs_change_the_values():
    """The comparison above can fail: summed in one run instead of runs of 512, or in the kernels'
    earlier order (exact 32-value blocks, rounded once each), many outputs differ."""
    rows, ids, packed, scales = _rows_case(5, 16, 2048, 128, 8)
    kernel = np.asarray(jax.jit(kernel_cpu.expert_rows)(rows, ids, packed, scales))
    w = np.asarray(jax.jit(formats.dequant_fp4_weight)(packed[ids], scales[ids]))
    x = np.asarray(rows)
    one_run = np.zeros_like(kernel)
    for i in range(x.shape[1]):
        one_run += x[:, i, None] * w[:, :, i]
    blocks = np.einsum(
        "mbj,mnbj->mnb",
        x.reshape(16, 64, 32).astype(np.float64),
        w.reshape(16, 128, 64, 32).astype(np.float64),
    ).astype(np.float32)
    blocked = blocks[..., 0].copy()
    for b in range(1, 64):
        blocked += blocks[..., b]
    assert 0.05 < np.mean(kernel != one_run) and 0.05 < np.mean(kernel != blocked)


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


# ----------------------------------------------------------------------- the FP8 linear kernel
def _linear_case(seed, m, k, n):
    """FP8-quantised rows (e4m3 values times a power of two per 32-value block, as the model's
    activation quantiser gives) and an e4m3 weight with ue8m0 scales per 32 x 32 block."""
    rng = np.random.default_rng(seed)
    codes = (rng.standard_normal((m, k)) * 4).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rows = codes * np.repeat(np.exp2(rng.integers(-8, 8, (m, k // 32))), 32, axis=1).astype(np.float32)
    weight = (rng.standard_normal((n, k)) * 8).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.integers(127 - 12, 127 + 12, (-(-n // 32), k // 32)).astype(np.uint8)
    return rows, weight, scales


@pytest.mark.parametrize("m, k, n", [(1, 32, 1), (3, 96, 33), (8, 512, 64), (40, 2048, 200), (70, 256, 17)])
def test_fp8_linear_rows_equal_the_run_order_bit_for_bit(m, k, n):
    rows, weight, scales = _linear_case(m * 5 + n, m, k, n)
    want = fp8_reference.linear_in_run_order(rows, weight, scales)
    vector = np.asarray(jax.jit(fp8_kernel.linear_rows)(rows, weight, scales))
    portable = np.asarray(jax.jit(lambda *a: fp8_kernel.linear_rows(*a, portable=True))(rows, weight, scales))
    assert np.isfinite(want).all()
    assert np.array_equal(vector, want)
    assert np.array_equal(portable, want)
    alone = np.asarray(jax.jit(fp8_kernel.linear_rows)(rows[-1:], weight, scales))
    assert np.array_equal(alone, want[-1:])  # a row's result does not depend on the other rows
    codes = np.asarray(jax.jit(fp8_kernel.linear_rows)(rows, weight.view(np.uint8), scales))
    assert np.array_equal(codes, want)  # the weight's uint8 codes read the same


def test_the_fp8_weight_reaches_the_kernel_without_a_copy():
    """An e4m3 weight goes to the custom call as it is: a bitcast to uint8 before it was a copy of the
    whole weight on every call in XLA:CPU's compiled program (27 ms of a 64 ms `mid` decode step)."""
    rows, weight, scales = _linear_case(3, 2, 256, 64)
    hlo = jax.jit(fp8_kernel.linear_rows).lower(rows, weight, scales).compile().as_text()
    assert "custom-call" in hlo and "f8e4m3fn[64,256]" in hlo
    assert "bitcast-convert" not in hlo and "copy(" not in hlo


def test_the_fp8_runs_change_the_values():
    """The comparison above can fail: summed in one run instead of runs of 512, many outputs differ."""
    rows, weight, scales = _linear_case(9, 16, 2048, 128)
    kernel = np.asarray(jax.jit(fp8_kernel.linear_rows)(rows, weight, scales))
    w = np.asarray(formats.dequant_fp8_weight(jnp.asarray(weight), jnp.asarray(scales)))
    one_run = np.zeros_like(kernel)
    for i in range(rows.shape[1]):
        one_run += rows[:, i, None] * w[None, :, i]
    assert 0.05 < np.mean(kernel != one_run)


def test_fp8_nan_codes_and_special_scales_read_as_the_dequantiser_reads_them():
    """e4m3 0x7F / 0xFF are NaN, a scale byte 255 is NaN and 0 reads as 0 (`formats.ue8m0_to_f32`): the
    kernel's outputs are NaN exactly where the XLA path's are, and equal elsewhere to the run order."""
    rows, weight, scales = _linear_case(4, 4, 128, 96)
    codes = weight.view(np.uint8).copy()
    codes[5, 40], codes[70, 3] = 0x7F, 0xFF
    scales[1, 2], scales[2, 0] = 255, 0
    weight = codes.view(ml_dtypes.float8_e4m3fn)
    kernel = np.asarray(jax.jit(fp8_kernel.linear_rows)(rows, weight, scales))
    xla = np.asarray(jax.jit(fp8_reference.linear)(rows, weight, scales))
    assert np.array_equal(np.isnan(kernel), np.isnan(xla)) and np.isnan(kernel).any()
    want = fp8_reference.linear_in_run_order(rows, weight, scales)
    assert np.array_equal(kernel, want, equal_nan=True)


def test_fp8_linear_shapes_are_checked_naming_the_argument():
    rows, weight, scales = _linear_case(2, 2, 64, 40)
    with pytest.raises(ValueError, match=r"weight must be \[N, 64\]"):
        fp8_kernel.linear_rows(rows, weight[:, :32], scales)
    with pytest.raises(ValueError, match=r"scales must be \[2, 2\] for a weight \[40, 64\]"):
        fp8_kernel.linear_rows(rows, weight, scales[:1])
    with pytest.raises(ValueError, match=r"K = 48 is not a multiple of the scale block 32"):
        fp8_kernel.linear_rows(rows[:, :48], weight[:, :48], scales)
    with pytest.raises(ValueError, match=r"rows must be f32"):
        fp8_kernel.linear_rows(rows.astype(np.float16), weight, scales)


# ----------------------------------------------------------------------- the indexer's scores
INDEX_CASES = [(0, 2, 5, 8, 128, 16, 6), (1, 3, 1, 4, 64, 8, 9)]


@pytest.mark.parametrize("seed, b, t, heads, dk, per_page, pages", INDEX_CASES)
def test_index_scores_equal_the_reference_bit_for_bit(seed, b, t, heads, dk, per_page, pages):
    """Poisoned (NaN-scaled) keys past every query's visible slots and -1 table slots, as the
    reference's own test case has them: the kernel never reads them into a visible score."""
    args = indexer_case(seed, b, t, heads, dk, per_page, pages).args()
    want = np.asarray(jax.jit(indexer_reference.index_scores)(*args))
    vector = np.asarray(jax.jit(index_kernel.index_scores)(*args))
    portable = np.asarray(jax.jit(lambda *a: index_kernel.index_scores(*a, portable=True))(*args))
    assert np.isfinite(want[want > -np.inf]).all() and (want > -np.inf).any()
    assert np.array_equal(vector, want)
    assert np.array_equal(portable, want)


@pytest.mark.parametrize("shift", [10, 16, 24])
def test_index_scores_equal_the_reference_with_blocks_scaled_far_apart(shift):
    """The kernel adds a dot's exact block sums in order; XLA's dot adds the same products in its own
    order, so they can only differ where a score's f32 dot rounds: here the query's second block is
    scaled 2^-shift against its first (still FP4-quantised values), so its products fall below the
    first block's last bit. The bf16 roundings after the dot absorb it: the scores stay equal."""
    case = indexer_case(shift, 1, 4, 4, 64, 8, 4)
    q = case.q.copy()
    q[..., 32:] *= np.float32(2.0**-shift)
    args = (jnp.asarray(q), *case.args()[1:])
    want = np.asarray(jax.jit(indexer_reference.index_scores)(*args))
    assert (want > -np.inf).sum() > 10
    assert np.array_equal(np.asarray(jax.jit(index_kernel.index_scores)(*args)), want)


def test_materialized_is_the_value_and_stays_in_the_program():
    """`_cpu.materialized` returns its operand unchanged (bits, dtype, NaNs) and survives XLA's
    optimisation as a custom call, which is what keeps consumers from recomputing it."""
    x = jnp.asarray(np.array([[1.5, -0.0, np.nan], [2.0**-140, 3.0, -7.25]], np.float32))
    fn = jax.jit(lambda a: _cpu.materialized(a * 2.0) + 1.0)
    got = np.asarray(fn(x))
    assert np.array_equal(got, np.asarray(x) * 2.0 + 1.0, equal_nan=True)
    assert "ced_materialize" in fn.lower(x).compile().as_text()
    bf = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    assert np.array_equal(np.asarray(jax.jit(_cpu.materialized)(bf)), np.asarray(bf))
