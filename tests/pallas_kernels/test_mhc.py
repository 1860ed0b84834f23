"""The mHC mixing kernels (interpret mode) equal the model's `ced_jax.model.layers.mhc.hc_mixes` bit for bit,
on tiny's own mixing weights and on random ones at other widths; the pure-jnp reference (XLA's own
sums) agrees to f32 rounding; bad inputs and tiles raise."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ced_jax
from ced_jax.model.layers.mhc import hc_mixes as model_mixes
from pallas_kernels.mhc import TileConfig, hc_mixes, reference

TILES = {"tpu": TileConfig(rows=8), "gpu": TileConfig(rows=16, k_chunk=128)}
KW = dict(iters=20, norm_eps=1e-20, hc_eps=1e-6)


def _bf16_exact(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.fixture(scope="module")
def tiny_site():
    """Layer 1's attention-site weights of the embedded tiny model and its config's constants."""
    model = ced_jax.load("tiny")
    layer = model.params["layers"]["1"]
    pick = lambda name: np.asarray(layer[name], np.float32)
    cfg = model.cfg
    kw = dict(iters=cfg.hc_sinkhorn_iters, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    return cfg.hc_mult, cfg.hidden_size, pick("hc_attn_fn"), pick("hc_attn_scale"), pick("hc_attn_base"), kw


def _random_site(seed, hc, d):
    rng = np.random.default_rng(seed)
    n_mix = (2 + hc) * hc
    fn = (rng.standard_normal((n_mix, hc * d)) / np.sqrt(hc * d)).astype(np.float32)
    scale, base = rng.uniform(0.5, 2, 3).astype(np.float32), rng.normal(0, 0.5, n_mix).astype(np.float32)
    return hc, d, fn, scale, base, KW


def _check(site, t, seed=0):
    hc, d, fn, scale, base, kw = site
    x = _bf16_exact(np.random.default_rng(seed).standard_normal((t, hc, d)) * 3)
    want = jax.jit(functools.partial(model_mixes, hc=hc, **kw))(x[None], fn, scale, base)
    for backend, cfg in TILES.items():
        run = functools.partial(hc_mixes, hc=hc, backend=backend, interpret=True, config=cfg, **kw)
        got = jax.jit(run)(x.reshape(t, -1), fn, scale, base)
        for name, g, w in zip(("pre", "post", "comb"), got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[0], err_msg=f"{backend} {name}")
    ref = jax.jit(functools.partial(reference.hc_mixes, hc=hc, **kw))(x.reshape(t, -1), fn, scale, base)
    for r, w in zip(ref, want, strict=True):
        np.testing.assert_allclose(np.asarray(r), np.asarray(w)[0], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t", [1, 9, 37])
def test_kernels_equal_the_models_mixing_on_tiny_weights(tiny_site, t):
    _check(tiny_site, t, seed=t)


@pytest.mark.parametrize("hc,d,t", [(4, 128, 24), (2, 512, 5)])
def test_kernels_equal_the_models_mixing_at_other_widths(hc, d, t):
    _check(_random_site(hc * d, hc, d), t, seed=d)


def test_bad_inputs_and_tiles_raise():
    hc, d, fn, scale, base, kw = _random_site(0, 4, 64)
    x = np.zeros((3, hc * d), np.float32)
    call = lambda *a, **k: hc_mixes(*a, hc=hc, interpret=True, **KW, **k)
    with pytest.raises(ValueError, match="fn must be f32"):
        call(x, fn[:, :-1], scale, base)
    with pytest.raises(ValueError, match="x must be f32"):
        call(x.astype(np.float16), fn, scale, base)
    with pytest.raises(ValueError, match="scale must be"):
        call(x, fn, scale[:2], base)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        call(x, fn, scale, base, backend="tpu", config=TileConfig(rows=12))
    with pytest.raises(NotImplementedError, match="power-of-two"):
        call(x, fn, scale, base, backend="gpu", config=TileConfig(rows=16, k_chunk=96))
