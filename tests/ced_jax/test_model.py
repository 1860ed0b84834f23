"""Model-level properties: chunked prefill, greedy decode consistency, no retrace, full-size shapes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ced_jax.api import load
from ced_jax.config import preset
from ced_jax.model import flatten_specs, param_specs
from ced_jax.sampling import jitted_sample
from tests.conftest import GOLDEN_TINY_A


@pytest.fixture(scope="module")
def model():
    return load(str(GOLDEN_TINY_A))


@pytest.fixture(scope="module")
def prompt():
    return [0] + np.random.default_rng(7).integers(3, 512, 40).tolist()


def test_chunked_prefill_equals_one_shot(model, prompt):
    one = model.logits(prompt, [5, 9, 11], capture=True)
    chunked = model.logits(prompt, [5, 9, 11], capture=True, prefill_chunk=13)
    for layer in model.cfg.index_source_layer_ids:
        np.testing.assert_array_equal(
            one[f"prefill_topk_layer{layer}"], chunked[f"prefill_topk_layer{layer}"]
        )
    np.testing.assert_array_equal(one["prefill_gate_indices"], chunked["prefill_gate_indices"])
    np.testing.assert_allclose(one["prefill_logits_full"], chunked["prefill_logits_full"], atol=2e-3, rtol=0)
    np.testing.assert_allclose(one["decode_logits"], chunked["decode_logits"], atol=2e-3, rtol=0)


def test_greedy_generation_equals_teacher_forced_argmax(model, prompt):
    out = model.generate(prompt, 6, temperature=0.0, stop_at_eos=False)["token_ids"]
    forced = model.logits(prompt, out[:-1])
    teacher = [int(forced["prefill_logits_full"][-1].argmax())] + forced["decode_logits"].argmax(-1).tolist()
    assert out == teacher


def test_no_retrace_over_50_decode_steps(model, prompt):
    session = model.new_session(1, 128)
    session.step(np.asarray(prompt)[None])
    session.step(np.asarray([[5]]))  # first decode step compiles
    tokens = [np.asarray([[int(t)]]) for t in np.random.default_rng(0).integers(3, 512, 50)]
    with jax.no_tracing():
        for tok in tokens:
            session.step(tok)
    assert session.positions[0] == len(prompt) + 51


def test_sampling_is_reproducible_for_a_seed(model, prompt):
    a = model.generate(prompt, 5, temperature=1.0, seed=3, stop_at_eos=False)["token_ids"]
    b = model.generate(prompt, 5, temperature=1.0, seed=3, stop_at_eos=False)["token_ids"]
    assert a == b


def test_sampled_generation_is_the_servers_sampler_on_teacher_forced_logits(model, prompt):
    """`generate` draws with `ced_jax.sampling` (the sampler the server compiles into its programs),
    keyed by (seed, position of the new token): the same draws over teacher-forced logits agree."""
    out = model.generate(prompt, 6, temperature=0.8, seed=11, stop_at_eos=False)["token_ids"]
    forced = model.logits(prompt, out[:-1])
    rows = np.concatenate([forced["prefill_logits_full"][-1:], forced["decode_logits"]])
    positions = np.arange(len(prompt), len(prompt) + len(out), dtype=np.int32)
    n = len(out)
    tokens, *_ = jitted_sample(0)(
        rows.astype(np.float32), positions, np.full(n, 0.8, np.float32),
        np.ones(n, np.float32), np.zeros(n, np.int32), np.full(n, 11, np.uint32),
    )  # fmt: skip
    assert out == np.asarray(tokens).tolist()
    other = model.generate(prompt, 6, temperature=0.8, seed=12, stop_at_eos=False)["token_ids"]
    assert other != out  # the seed matters (6 draws at T=0.8 over 512 ids)


def test_full_size_parameter_tree_counts():
    """The whole v41-flash parameter tree, abstractly (`param_specs`): no memory is allocated."""
    specs = flatten_specs(param_specs(preset("v41-flash")))
    params = 0
    for name, spec in specs.items():
        if name.endswith("scale") and not name.endswith(("hc_attn_scale", "hc_ffn_scale")):
            continue
        n = int(np.prod(spec.shape))
        params += 2 * n if ".experts." in name and name.endswith("weight") else n
    # backbone + Engram tables; the scale bytes are not parameters, wo_a is stored dequantised
    assert params == 551_880_835_184 + 196_613_849_600
    assert specs["layers.2.attn.wq_b.weight"].shape == (64 * 512, 1280)
    assert specs["layers.20.ffn.experts.w1.weight"].shape == (384, 2304, 5120 // 2)


def test_unknown_impl_is_refused_at_load():
    with pytest.raises(NotImplementedError, match="impl='triton' is not available"):
        load("tiny", impl="triton")


def test_patching_targets_chosen_layers(model, prompt):
    """`patch_layers` replaces the block inputs of the chosen layers only: blocks below the first
    patched layer produce exactly what an unpatched run produces, the patched one and those above do
    not; naming no layer patches nothing."""
    cfg = model.cfg
    L, t, M, D = cfg.num_layers, len(prompt), cfg.hc_mult, cfg.hidden_size
    patch = {
        "prefill_block_input": np.zeros((L, t, M, D), np.float32),
        "prefill_pre_mix_input": np.full((L, t, M), 1.0 / M, np.float32),
    }
    plain = model.logits(prompt)
    none = model.logits(prompt, patch=patch, patch_layers=[])
    np.testing.assert_array_equal(none["prefill_logits_full"], plain["prefill_logits_full"])
    chosen = 2
    one = model.logits(prompt, patch=patch, patch_layers=[chosen])
    below, above = one["prefill_block_output"][:chosen], one["prefill_block_output"][chosen:]
    np.testing.assert_array_equal(below, none["prefill_block_output"][:chosen])
    assert np.all(np.any(above != none["prefill_block_output"][chosen:], axis=(1, 2, 3)))
    assert not np.array_equal(one["prefill_logits_full"], plain["prefill_logits_full"])
    with pytest.raises(ValueError, match=r"patch_layers: layer 99 is outside"):
        model.logits(prompt, patch=patch, patch_layers=[99])
    with pytest.raises(ValueError, match=r"patch_layers: given without block inputs"):
        model.logits(prompt, patch_layers=[1])
