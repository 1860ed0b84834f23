"""Every kernel lowers for its real backend on this CPU machine (`jax.export`, no hardware): TPU
kernels to a Mosaic `tpu_custom_call`, GPU kernels to a Triton call, at tiny and v41-flash shapes.
This catches block-shape, tiling and power-of-two errors of the Pallas lowering; what only the
Mosaic compiler in libtpu or ptxas would reject still needs a device (bench/device_check.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels.grouped_matmul import gmm
from pallas_kernels.indexer import index_topk
from pallas_kernels.mhc import hc_mixes
from pallas_kernels.sparse_attention import sparse_attention_decode, sparse_attention_prefill

S = jax.ShapeDtypeStruct
PLATFORM = {"tpu": "tpu", "gpu": "cuda"}
CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}
_CHECKS = [export.DisabledSafetyCheck.custom_call(name) for name in CALL.values()]


def _lower(fn, backend, *args) -> str:
    exported = export.export(jax.jit(fn), platforms=[PLATFORM[backend]], disabled_checks=_CHECKS)(*args)
    return exported.mlir_module()


def gmm_args(m, k, n, e):
    return (
        S((m, k), jnp.float32),
        S((e, n, k // 2), jnp.uint8),
        S((e, n, k // 32), jnp.uint8),
        S((e,), jnp.int32),
    )


# (M, K, N, E): tiny; v41 decode batch 64 through w1/w3 (K = D) and w2 (K = F); prefill 4K tokens.
# E = 192 (experts over 2 devices): one device holding all 384 experts of w1 would exceed 2 GiB.
GMM_SHAPES = [(40, 256, 128, 5), (384, 5120, 2304, 192), (384, 2304, 5120, 192), (24576, 5120, 2304, 192)]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", GMM_SHAPES, ids=lambda s: "M{}K{}N{}E{}".format(*s))
def test_gmm_lowers(backend, shape):
    assert CALL[backend] in _lower(functools.partial(gmm, backend=backend), backend, *gmm_args(*shape))


def attention_args(b, t, h, d, window, n_sel, decode):
    lead = (b,) if decode else (b, t)
    segs = [
        (S((b, window, d + d // 32), jnp.uint8), S((b, 1), jnp.int32), S(lead + (window,), jnp.int32)),
        (S((b * 64, 64, d // 2 + d // 16), jnp.uint8), S((b, 64), jnp.int32), S(lead + (n_sel,), jnp.int32)),
    ]
    return S(lead + (h, d), jnp.float32), segs, S((h,), jnp.float32)


# (B, T, H, D, window, selected): v41 decode batch 64 and a 4K-token prefill chunk; a tiny odd one.
ATTN_SHAPES = [
    (3, 5, 4, 128, 8, 16, False),
    (64, 1, 64, 512, 128, 512, True),
    (1, 4096, 64, 512, 128, 512, False),
]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "B{}T{}H{}D{}".format(*s))
def test_sparse_attention_lowers(backend, shape):
    decode = shape[-1]
    fn = sparse_attention_decode if decode else sparse_attention_prefill
    call = functools.partial(fn, scale=0.04, backend=backend)
    assert CALL[backend] in _lower(call, backend, *attention_args(*shape))


# (B, T, I, Dk, keys per page, pages per sequence): v41 decode at 64K context, prefill of 4K.
INDEX_SHAPES = [(2, 5, 8, 128, 128, 3), (64, 1, 32, 128, 128, 256), (1, 4096, 32, 128, 128, 16)]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", INDEX_SHAPES, ids=lambda s: "B{}T{}I{}".format(*s))
def test_indexer_lowers(backend, shape):
    b, t, i, dk, per_page, n = shape
    args = (
        S((b, t, i, dk), jnp.float32),
        S((b, t, i), jnp.float32),
        S((b * n, per_page, dk // 2 + dk // 32), jnp.uint8),
        S((b, n), jnp.int32),
        S((b, t), jnp.int32),
    )
    call = functools.partial(index_topk, top_k=512, backend=backend)
    assert CALL[backend] in _lower(call, backend, *args)


# (tokens, hc * D): tiny's width at an odd token count; v41-flash (4 x 4096) at a decode batch of 64
# and a 4K-token prefill chunk.
MHC_SHAPES = [(37, 1024), (64, 16384), (4096, 16384)]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", MHC_SHAPES, ids=lambda s: "T{}K{}".format(*s))
def test_mhc_mixing_lowers(backend, shape):
    t, k = shape
    args = (S((t, k), jnp.float32), S((24, k), jnp.float32), S((3,), jnp.float32), S((24,), jnp.float32))
    call = functools.partial(hc_mixes, hc=4, iters=20, norm_eps=1e-20, hc_eps=1e-6, backend=backend)
    assert CALL[backend] in _lower(call, backend, *args)
