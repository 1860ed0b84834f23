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
