"""Parity with DeepSeek's reference on the golden fixture tiny-a, in the three modes of PARITY.md.

The bars are PARITY.md's, unchanged. Mode A replays the recorded decisions and patches every
block input, then compares what each block produced; modes B and C are smoke tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

import ced_jax
from ced_jax.api import load
from ced_jax.options import REFERENCE
from tests.conftest import GOLDEN_TINY_A

MODES = ("intended", "reference")


@pytest.fixture(scope="module")
def golden():
    return load_file(str(GOLDEN_TINY_A / "expected.safetensors"))


@pytest.fixture(scope="module")
def model():
    return load(str(GOLDEN_TINY_A))


def _kl(ref_logits: np.ndarray, our_logits: np.ndarray) -> np.ndarray:
    """KL(ref || ours) per row, in f64."""

    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(our_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def _replay(g, cfg, mode: str) -> dict:
    return ced_jax.fixture_decisions(g, mode)[0]


def _patch(g, mode: str) -> dict:
    return ced_jax.fixture_decisions(g, mode)[1]


@pytest.mark.parametrize("mode", ["intended", "reference"])
def test_fixture_decisions_take_the_modes_arrays(golden, model, mode):
    """`ced_jax.fixture_decisions`: the prefill's recorded arrays and the decode run's of the mode, under
    the names `Model.logits` takes; `logits` applies it itself to a fixture given as it is."""
    replay, patch = ced_jax.fixture_decisions(golden, mode)
    want = {"prefill_gate_indices": golden["prefill_gate_indices"],
            "decode_gate_indices": golden[f"decode_{mode}_gate_indices"]}  # fmt: skip
    for layer in model.cfg.index_source_layer_ids:
        want[f"prefill_topk_layer{layer}"] = golden[f"prefill_topk_layer{layer}"]
        want[f"decode_topk_layer{layer}"] = golden[f"decode_{mode}_topk_layer{layer}"]
    assert replay.keys() == want.keys() and all(replay[k] is want[k] for k in want)
    assert sorted(patch) == ["decode_block_input", "decode_pre_mix_input", "prefill_block_input",
                             "prefill_pre_mix_input"]  # fmt: skip
    assert all(patch[k] is golden[k] for k in patch if k.startswith("prefill"))
    assert all(
        patch[k] is golden[k.replace("decode_", f"decode_{mode}_")] for k in patch if k.startswith("decode")
    )


def _rows_equal_up_to_ties(own: np.ndarray, rec: np.ndarray, scores: np.ndarray) -> list[bool]:
    """Per row: do the two selections have the same multiset of (bf16) scores? A tie can also sit
    one level up, among the candidate blocks of a Reindex layer's pool."""
    equal = []
    for o, r, s in zip(own, rec, scores, strict=True):
        so = np.sort(s[o[o >= 0]])
        sr = np.sort(s[r[r >= 0]])
        equal.append(so.shape == sr.shape and np.array_equal(so, sr))
    return equal


def mode_a_run(model, g, mode: str) -> dict:
    """The mode-A run: recorded decisions replayed, every block input patched, decisions captured."""
    return model.logits(
        g["prompt_ids"],
        g["decode_ids"],
        index_k_mode=mode,
        replay=g,  # the fixture as it is: logits takes the mode's arrays (ced_jax.fixture_decisions)
        patch=g,
        capture=True,
    )


def mode_a_metrics(model, g, mode: str, res: dict | None = None) -> dict:
    """PARITY.md's mode-A metrics of `res` (by default a fresh `mode_a_run`)."""
    cfg = model.cfg
    res = mode_a_run(model, g, mode) if res is None else res
    L = cfg.num_layers
    # Block entries: each prefill block (all tokens) and each decode block with a recorded successor.
    ref_prefill = np.concatenate([g["prefill_block_input"][1:], g["prefill_last_block_output"][None]])
    entries = []
    for layer in range(L):
        ours, ref = res["prefill_block_output"][layer], ref_prefill[layer]
        entries.append(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    ref_decode = g[f"decode_{mode}_block_input"]
    for layer in range(L - 1):
        ours, ref = res["decode_block_output"][:, layer], ref_decode[:, layer + 1]
        entries.append(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    entries = np.asarray(entries)
    topk_eq = []
    for layer in cfg.index_source_layer_ids:
        topk_eq.extend(
            _rows_equal_up_to_ties(
                res[f"prefill_topk_layer{layer}"],
                g[f"prefill_topk_layer{layer}"],
                g[f"prefill_index_scores_layer{layer}"],
            )
        )
        topk_eq.extend(
            _rows_equal_up_to_ties(
                res[f"decode_topk_layer{layer}"],
                g[f"decode_{mode}_topk_layer{layer}"],
                g[f"decode_{mode}_index_scores_layer{layer}"],
            )
        )
    own_e = np.concatenate(
        [
            res["prefill_gate_indices"].reshape(-1, cfg.num_experts_per_tok),
            res["decode_gate_indices"].reshape(-1, cfg.num_experts_per_tok),
        ]
    )
    rec_e = np.concatenate(
        [
            g["prefill_gate_indices"].reshape(-1, cfg.num_experts_per_tok),
            g[f"decode_{mode}_gate_indices"].reshape(-1, cfg.num_experts_per_tok),
        ]
    )
    return {
        "block_mean": entries.mean(),
        "block_above": int((entries > 5e-3).sum()),
        "block_max": entries.max(),
        "n_entries": len(entries),
        "prefill_abs": np.abs(res["prefill_logits_full"] - g["prefill_logits_full"]).mean(),
        "prefill_kl": _kl(g["prefill_logits_full"], res["prefill_logits_full"]).mean(),
        "decode_max_abs": np.abs(res["decode_logits"] - g[f"decode_logits_{mode}"]).max(axis=-1),
        "topk_rows_equal": float(np.mean(topk_eq)),
        "expert_rows_equal": np.mean(np.all(np.sort(own_e, -1) == np.sort(rec_e, -1), -1)),
    }


@pytest.fixture(scope="module")
def mode_a(model, golden):
    return {mode: mode_a_metrics(model, golden, mode) for mode in MODES}


def assert_mode_a_block_bars(m: dict) -> None:
    """PARITY.md's mode-A bars on `mode_a_metrics` output, all but the decode logits."""
    assert m["n_entries"] == 15
    assert m["block_mean"] <= 3e-3, m
    assert m["block_above"] <= 2, m
    assert m["block_max"] <= 1.5e-2, m
    assert m["prefill_abs"] <= 4e-3, m
    assert m["prefill_kl"] <= 4e-5, m
    assert m["topk_rows_equal"] >= 0.99, m
    assert m["expert_rows_equal"] >= 0.995, m


def assert_mode_a_gate(m: dict) -> None:
    """Every mode-A bar of PARITY.md, decode logits included."""
    assert_mode_a_block_bars(m)
    assert np.all(m["decode_max_abs"] <= 0.03), m["decode_max_abs"]


@pytest.mark.parametrize("mode", MODES)
def test_mode_a_layer_local(mode_a, mode):
    assert_mode_a_block_bars(mode_a[mode])


@pytest.mark.parametrize("mode", MODES)
def test_mode_a_decode_logits(mode_a, mode):
    assert np.all(mode_a[mode]["decode_max_abs"] <= 0.03), mode_a[mode]["decode_max_abs"]


@pytest.mark.parametrize("mode", MODES)
def test_mode_b_decisions_replayed(model, golden, mode):
    g = golden
    res = model.logits(g["prompt_ids"], g["decode_ids"], index_k_mode=mode, replay=g)
    ours, ref = res["prefill_logits_full"], g["prefill_logits_full"]
    assert np.abs(ours - ref).mean() <= 0.18
    assert _kl(ref, ours).mean() <= 0.025
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.78
    assert _kl(g[f"decode_logits_{mode}"], res["decode_logits"]).mean() <= 0.03


@pytest.mark.parametrize("mode", MODES)
def test_mode_c_free_running(model, golden, mode):
    g = golden
    res = model.logits(g["prompt_ids"], g["decode_ids"], index_k_mode=mode, capture=True)
    ours, ref = res["prefill_logits_full"], g["prefill_logits_full_stableties"]
    assert _kl(ref, ours).mean() <= 0.15
    assert np.abs(ours - ref).mean() <= 0.35
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.70
    assert _kl(g[f"decode_logits_{mode}_stableties"], res["decode_logits"]).mean() <= 0.30
    overlaps = []
    for layer in model.cfg.index_source_layer_ids:
        for o, r in zip(
            res[f"prefill_topk_layer{layer}"], g[f"prefill_topk_layer{layer}_stableties"], strict=True
        ):
            rv = set(r[r >= 0].tolist())
            if rv:
                overlaps.append(len(set(o[o >= 0].tolist()) & rv) / len(rv))
    assert np.mean(overlaps) >= 0.88


def test_negative_control_sink_dropped_fails_mode_a(golden, monkeypatch, fresh_programs):
    """A deliberately broken variant (attention sink dropped) must fail the mode-A gate."""
    import ced_jax.model.layers.attention as attention_module
    from ced_jax.model.layers import kernels

    real = kernels.sparse_attention

    def no_sink(q, segments, sink, scale, *, impl=REFERENCE):
        return real(q, segments, sink * 0 - 1e30, scale, impl=impl)

    monkeypatch.setattr(attention_module.kernels, "sparse_attention", no_sink)
    broken = load(str(GOLDEN_TINY_A))  # programs of its own (fresh_programs), traced with the patch
    m = mode_a_metrics(broken, golden, "intended")
    assert m["block_mean"] > 3e-3 or m["prefill_abs"] > 4e-3 or m["block_above"] > 2
