"""bench/launches.py (issue 35.1): its count of a compiled program's kernels, on small programs whose
structure is known, and its layer-truncated configs."""

import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def launches():
    spec = importlib.util.spec_from_file_location("launches", REPO / "bench" / "launches.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _compiled_text(trips: int) -> str:
    def f(x):
        with jax.named_scope("layer1"):
            y = jnp.sort(x) * 2.0
        body = lambda _, c: jnp.sort(c[::-1]) + 1.0
        return jax.lax.fori_loop(0, trips, body, y)

    return jax.jit(f).lower(jax.ShapeDtypeStruct((64,), np.float32)).compile().as_text()


def test_a_loop_counts_once_statically_and_per_trip_per_step(launches):
    three, seven = (launches.count_launches(_compiled_text(n)) for n in (3, 7))
    assert three.static == seven.static
    assert three.unknown_trip_counts == seven.unknown_trip_counts == 0
    per_trip = (seven.per_step - three.per_step) / 4
    assert per_trip >= 1 and per_trip == int(per_trip)
    assert seven.per_step == three.per_step + 4 * per_trip
    assert three.by_kind["sort"] == 1 + 3 and seven.by_kind["sort"] == 1 + 7
    assert three.by_layer[1] >= 1  # the sort outside the loop, in its named scope


def test_truncated_v41_flash_keeps_its_layer_kinds(launches):
    cfg = launches._config("v41-flash", 10)
    assert cfg.num_layers == 10
    assert cfg.kv_source_layer_ids == (2, 8) and cfg.engram_layer_ids == (1,)
    assert cfg.candidate_source_layer_id == -1
    full = launches._config("v41-flash", None)
    assert [cfg.layer_kind(i) for i in range(10)] == [full.layer_kind(i) for i in range(10)]


def test_the_mhc_mixing_is_counted_with_its_sinkhorn_loop(launches):
    """Two mixing sites (each its own jit, with a Sinkhorn loop) beside other work: every kernel of the
    sites, their loops' counters included, is attributed to them, and nothing else is."""
    from ced_jax.model.layers.mhc import hc_mixes

    def f(x, fn, scale, base):
        kw = dict(hc=4, iters=5, norm_eps=1e-20, hc_eps=1e-6)
        a = hc_mixes(x, fn, scale, base, **kw)
        b = hc_mixes(jnp.sort(x * 2.0, axis=-1), fn, scale, base, **kw)
        return jnp.sort(a[2].sum() + b[2].sum() + x.sum(-1), axis=-1)

    shapes = ((2, 3, 4, 32), (24, 128), (3,), (24,))
    args = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    text = jax.jit(f).lower(*args).compile().as_text()
    c = launches.count_launches(text)
    alone = jax.jit(lambda *a: hc_mixes(*a, hc=4, iters=5, norm_eps=1e-20, hc_eps=1e-6))
    one = launches.count_launches(alone.lower(*args).compile().as_text())
    # A program that is only the mixing: all of it but the copy of its loop counter's start, which XLA
    # makes without metadata (the count is a lower bound by one kernel per site).
    assert one.per_step - 1 <= one.mhc_per_step < one.per_step
    assert c.mhc_per_step >= 2 * (4 + 4 + 2)  # two sites, each at least four loop trips of kernels
    assert c.per_step - c.mhc_per_step >= 2  # the sorts are not the mixing's
