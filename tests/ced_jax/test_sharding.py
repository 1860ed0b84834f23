"""Sharded execution on 8 fake CPU devices: rules, layouts, and mode-A parity against one device.

Tolerance (sharded vs single device, on tiny-a in mode A of PARITY.md): the decisions taken
(top-k rows, expert ids) are identical, every logit within 1e-3 absolute (except one flipped bf16
rounding of the head's input, see FLIPPED_ROWS), every block output within 1e-4 relative L2. Only
fp32 reduction order may differ (the MoE is exact by construction: its width splits are undone by
all-gathers, not partial sums).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from safetensors.numpy import load_file

from ced_jax import sharding
from ced_jax.api import load
from ced_jax.config import ModelConfig
from ced_jax.layers.moe import EXPERT_AXES
from ced_jax.model import flatten_specs, param_specs
from tests.ced_jax.test_parity import assert_mode_a_gate, mode_a_metrics, mode_a_run
from tests.conftest import GOLDEN_TINY_A, REPO

MODE = "intended"
LOGIT_ATOL = 1e-3
BLOCK_REL = 1e-4
# The head's input is the final hc collapse + norm, rounded to bf16 after the last block; an fp32
# reduction-order difference in it can flip one bf16 rounding of one element, which moves that row's
# logits by one bf16 ulp x |head column| (<= 1e-2 here). Measured on (1, 4, 2), one process or two:
# every decision and every block output bit-identical, decode logits bit-identical, 99 of 100 prefill
# rows bit-identical, row 98 off by 3.4e-3 (one element of its final hidden vector one bf16 step
# apart: -1.2266 vs -1.2344). At most this many prefill rows may exceed LOGIT_ATOL, none FLIPPED_ATOL.
FLIPPED_ROWS, FLIPPED_ATOL = 1, 1e-2


def _mesh(d: int, e: int, t: int):
    return sharding.make_mesh({"data": d, "expert": e, "tensor": t})


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_pretrained(GOLDEN_TINY_A)


# ------------------------------------------------------------------ rules and layouts
def test_rules_tables_name_every_logical_axis():
    for name, table in sharding.RULES.items():
        assert set(table) == set(sharding.LOGICAL_AXES), name
        sharding.check_rules(table)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.check_rules({"vocab": "model"})
    with pytest.raises(ValueError, match="unknown sharding rules"):
        sharding.get_rules("fsdp")


def test_parse_and_make_mesh():
    assert sharding.parse_mesh("expert=4,tensor=2") == {"data": 1, "expert": 4, "tensor": 2}
    for bad in ("expert=x", "pipeline=2", "tensor=0"):
        with pytest.raises(ValueError, match="--mesh"):
            sharding.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 16 devices, 8 are available"):
        _mesh(2, 4, 2)


def test_logical_to_spec_keeps_indivisible_dims_replicated():
    sizes = {"data": 1, "expert": 4, "tensor": 8}
    rules = sharding.EP_TP_RULES
    assert sharding.logical_to_spec(("q_heads",), rules, (4,), sizes) == jax.P(None)  # 4 heads / 8
    assert sharding.logical_to_spec(("vocab", "embed"), rules, (512, 256), sizes) == jax.P("tensor", None)
    spec = sharding.logical_to_spec(EXPERT_AXES, rules, (8, 128, 128), sizes)
    assert spec == jax.P("expert", "tensor", None)
    assert sharding.shard_shape((8, 128, 128), spec, sizes) == (2, 16, 128)
    # A size-1 mesh axis is dropped, and a mesh axis is used once per array.
    assert sharding.logical_to_spec(("experts",), rules, (8,), {"expert": 1}) == jax.P(None)
    assert sharding.logical_to_spec(("vocab", "q_heads"), rules, (8, 8), sizes) == jax.P("tensor", None)


def test_param_shardings_place_every_parameter(cfg):
    mesh = _mesh(1, 4, 2)
    specs = param_specs(cfg)
    shardings = sharding.param_shardings(specs, mesh, sharding.EP_TP_RULES)
    flat = flatten_specs(specs)
    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert len(leaves) == len(flat)
    ffn = shardings["layers"]["0"]["ffn"]
    assert ffn["experts"]["w1"]["weight"].spec == jax.P("expert", "tensor", None)
    assert ffn["experts"]["w2"]["scale"].spec == jax.P("expert", "tensor", None)
    assert ffn["gate"]["weight"].spec == jax.P(None, None)  # the router is replicated
    assert shardings["embed"]["weight"].spec == jax.P("tensor", None)
    tp = sharding.param_shardings(specs, mesh, sharding.TP_RULES)
    assert tp["layers"]["0"]["ffn"]["experts"]["w1"]["weight"].spec == jax.P(None, "tensor", None)


@pytest.mark.parametrize(
    "shape, ep, f, d, token_axes",
    [
        ((1, 8, 1), "expert", None, None, ("expert",)),
        ((1, 4, 2), "expert", "tensor", "tensor", ("expert",)),
        ((2, 2, 2), "expert", "tensor", "tensor", ("data", "expert")),
        ((1, 1, 8), None, "tensor", "tensor", ()),
    ],
)
def test_moe_layout(cfg, shape, ep, f, d, token_axes):
    E, F, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    zeros = lambda *s: jax.ShapeDtypeStruct(s, np.uint8)
    experts = {
        "w1": {"weight": zeros(E, F, D // 2), "scale": zeros(E, F, D // 32)},
        "w3": {"weight": zeros(E, F, D // 2), "scale": zeros(E, F, D // 32)},
        "w2": {"weight": zeros(E, D, F // 2), "scale": zeros(E, D, F // 32)},
    }
    layout = sharding.Layout(_mesh(*shape), sharding.EP_TP_RULES)
    ml = sharding.moe_layout(layout, EXPERT_AXES, experts)
    assert (ml.ep_axis, ml.f_axis, ml.d_axis, ml.token_axes) == (ep, f, d, token_axes)


def test_no_partition_specs_outside_the_rules_module():
    """Acceptance 5: every PartitionSpec comes from ced_jax.sharding (tests may compare against
    literal specs)."""
    pattern = re.compile(r"PartitionSpec|\bjax\.P\(|import[^\n]*\bP\b")
    offenders = []
    for package in ("ced_jax", "conversion", "serving", "ced_cli", "pallas_kernels", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "ced_jax" / "sharding.py" or "_pb2" in path.name:
                continue
            if pattern.search(path.read_text()):
                offenders.append(str(Path(path).relative_to(REPO)))
    assert not offenders, offenders


# ------------------------------------------------------------------ mode A on meshes
@pytest.fixture(scope="module")
def golden():
    return load_file(str(GOLDEN_TINY_A / "expected.safetensors"))


@pytest.fixture(scope="module")
def single(golden):
    return mode_a_run(load(str(GOLDEN_TINY_A)), golden, MODE)


def _check_against_single(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, ref in want.items():
        ours = got[key]
        if "topk" in key or "gate_indices" in key:
            np.testing.assert_array_equal(ours, ref, err_msg=key)
        elif key == "prefill_logits_full":
            row_err = np.abs(ours - ref).max(axis=-1)
            assert row_err.max() <= FLIPPED_ATOL, (key, row_err.max())
            assert int((row_err > LOGIT_ATOL).sum()) <= FLIPPED_ROWS, (key, np.nonzero(row_err > LOGIT_ATOL))
        elif "logits" in key:
            np.testing.assert_allclose(ours, ref, atol=LOGIT_ATOL, rtol=0, err_msg=key)
        else:  # block outputs [.., L, ...]: each block by its own norm
            axis = 0 if key == "prefill_block_output" else 1
            for layer in range(ref.shape[axis]):
                a, b = np.take(ours, layer, axis=axis), np.take(ref, layer, axis=axis)
                rel = np.linalg.norm(a - b) / np.linalg.norm(b)
                assert rel <= BLOCK_REL, (key, layer, rel)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((1, 8, 1), marks=pytest.mark.slow),
        (1, 4, 2),
        pytest.param((2, 2, 2), marks=pytest.mark.slow),
        pytest.param((1, 1, 8), marks=pytest.mark.slow),
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_mesh_mode_a_matches_single_device(golden, single, shape):
    model = load(str(GOLDEN_TINY_A), mesh=_mesh(*shape))
    w1 = model.params["layers"]["0"]["ffn"]["experts"]["w1"]["weight"]
    assert len(w1.sharding.device_set) == 8
    got = mode_a_run(model, golden, MODE)
    _check_against_single(got, single)
    # And the sharded run passes PARITY.md's mode-A gate against DeepSeek's reference itself.
    assert_mode_a_gate(mode_a_metrics(model, golden, MODE, res=got))
