"""FP4 grouped matmul: both Pallas kernels (interpret mode) equal the reference bit for bit on
ragged groups with empty experts and NaN-poisoned padding; unsupported tiles raise while tracing."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import formats
from pallas_kernels.grouped_matmul import TileConfig, gmm, reference
from tests.pallas_kernels.cases import gmm_case

# (seed, M, K, N, E, fill): seeded "random" shapes, kept tiny (interpret mode is slow).
CASES = [(0, 37, 128, 128, 5, 0.8), (1, 64, 256, 256, 3, 1.0)]
TILES = {"tpu": TileConfig(tm=16, tn=128), "gpu": TileConfig(tm=16, tn=64, tk=128)}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "M{1}K{2}N{3}E{4}".format(*c))
def case_and_ref(request):
    seed, m, k, n, e, fill = request.param
    case = gmm_case(seed, m, k, n, e, fill)
    return case, np.asarray(jax.jit(reference.gmm)(*case.args()))


def test_reference_matches_dense_dequantised_product(case_and_ref):
    case, ref = case_and_ref
    w = np.asarray(jax.jit(formats.dequant_fp4_weight)(case.w_packed, case.w_scale))
    offsets = np.concatenate([[0], np.cumsum(case.group_sizes)])
    expect = np.zeros_like(ref)
    for g in range(len(case.group_sizes)):
        lo, hi = offsets[g], offsets[g + 1]
        expect[lo:hi] = case.lhs[lo:hi].astype(np.float64) @ w[g].T.astype(np.float64)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(ref, expect, rtol=1e-6, atol=1e-6 * np.abs(expect).max())
    assert not ref[offsets[-1] :].any()


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernel_matches_reference(case_and_ref, backend):
    case, ref = case_and_ref
    run = jax.jit(functools.partial(gmm, backend=backend, interpret=True, config=TILES[backend]))
    out = np.asarray(run(*case.args()))
    # Products are exact (bf16-exact operands); only the f32 summation order may differ.
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


def test_all_groups_empty_gives_zeros():
    case = gmm_case(3, 24, 64, 128, 2, fill=0.0)
    case.group_sizes[:] = 0
    run = jax.jit(functools.partial(gmm, backend="tpu", interpret=True, config=TileConfig(tm=8, tn=128)))
    out = run(*case.args())
    assert not np.asarray(out).any()


def test_unsupported_tiles_raise_at_trace_time():
    case = gmm_case(0, 16, 64, 128, 2)
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in case.args()]
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        jax.eval_shape(
            lambda *a: gmm(*a, backend="tpu", interpret=True, config=TileConfig(tm=4, tn=128)), *sds
        )
    with pytest.raises(NotImplementedError, match="power-of-two"):
        jax.eval_shape(
            lambda *a: gmm(*a, backend="gpu", interpret=True, config=TileConfig(tm=24, tn=64, tk=64)), *sds
        )
    with pytest.raises(NotImplementedError, match="interpret"):
        jax.eval_shape(lambda *a: gmm(*a), *sds)  # CPU without interpret: no silent fallback
    with pytest.raises(ValueError, match="w_scale"):
        gmm(case.args()[0], case.args()[1], case.args()[2][:, :, :1], case.args()[3], interpret=True)
