"""ModelConfig: the released nested config.json, presets, and clear errors for bad configs."""

from __future__ import annotations

import copy
import json

import pytest

from ced_jax.config import PRESETS, ConfigError, ModelConfig, preset
from tests.conftest import GOLDEN_TINY_A


def _raw():
    return json.loads((GOLDEN_TINY_A / "config.json").read_text())


def test_reads_the_released_layout():
    cfg = ModelConfig.from_pretrained(GOLDEN_TINY_A)
    assert cfg.layer_kinds == ("swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse")
    assert cfg.kv_source_of(7) == 4 and cfg.index_source_of(7) == 6 and cfg.index_source_of(3) == 2
    assert cfg.uses_candidates(6) and not cfg.uses_candidates(4)
    assert cfg.rms_norm_eps == 1e-20 and cfg.weight_block_size == 32


def test_round_trip_and_presets():
    for name in ("tiny", "v41-flash"):
        cfg = preset(name)
        assert ModelConfig.from_hf_config(cfg.to_hf_dict()) == cfg
    flash = preset("v41-flash")
    assert flash.layer_kinds.count("full") == 4 and flash.layer_kinds.count("reindex") == 4
    assert flash.layer_kinds.count("reuse") == 30 and flash.layer_kinds.count("swa") == 2
    tiny = preset("tiny")
    assert set(tiny.layer_kinds) == {"swa", "full", "reuse", "reindex"} and tiny.engram_layer_ids
    # One of each: SWA-only, Full r=2, Reuse, Full r=1 (the candidate source), Reindex, Engram.
    full = [i for i, kind in enumerate(tiny.layer_kinds) if kind == "full"]
    assert sorted(tiny.compress_ratio(i) for i in full) == [1, 2]
    src = tiny.candidate_source_layer_id
    assert tiny.layer_kinds[src] == "full" and tiny.compress_ratio(src) == 1
    assert any(tiny.uses_candidates(i) for i, kind in enumerate(tiny.layer_kinds) if kind == "reindex")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["text_config"].__setitem__("brand_new_key", 1), "brand_new_key"),
        (lambda r: r.__setitem__("mystery", 1), "mystery"),
        (lambda r: r["text_config"].pop("hidden_size"), "hidden_size"),
        (lambda r: r["text_config"].__setitem__("hidden_size", "wide"), "hidden_size"),
        (lambda r: r["text_config"].__setitem__("num_key_value_heads", 8), "num_key_value_heads"),
        (lambda r: r["text_config"].__setitem__("kv_source_layer_ids", [2, 5]), "kv_source_layer_ids"),
        (lambda r: r["quantization_config"].__setitem__("weight_block_size", [128, 64]), "weight_block_size"),
        (lambda r: r["text_config"]["rope_scaling"].__setitem__("rope_type", "linear"), "rope_type"),
        (lambda r: r.pop("text_config"), "text_config"),
        (lambda r: r["quantization_config"].__setitem__("new_knob", 1), "new_knob"),
        (lambda r: r["text_config"]["rope_scaling"].__setitem__("new_rope_knob", 1), "new_rope_knob"),
    ],
)
def test_bad_configs_name_the_key(mutate, message):
    raw = copy.deepcopy(_raw())
    mutate(raw)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(raw)


def test_unknown_vision_key_is_named():
    raw = preset("v41-flash").to_hf_dict()
    raw["vision_config"]["new_vision_knob"] = 1
    with pytest.raises(ConfigError, match="vision_config.*new_vision_knob"):
        ModelConfig.from_hf_config(raw)


def test_renamed_preset_warns_and_is_its_new_name():
    with pytest.warns(DeprecationWarning, match="'tiny-draft'"):
        old = preset("tiny-spec")
    assert old == preset("tiny-draft")
    assert "tiny-spec" not in PRESETS  # listings (an unknown preset's error) show only the new name


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("v9")
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_attention_heads", 0, "num_attention_heads: must be >= 1, got 0"),
        ("hc_mult", 0, "hc_mult: must be >= 1, got 0"),
        ("index_topk", -5, "index_topk: must be >= 1, got -5"),
        ("sliding_window", 0, "sliding_window: must be >= 1, got 0"),
        ("num_experts_per_tok", 9, "num_experts_per_tok: must be <= n_routed_experts=8, got 9"),
        ("rope_theta", -1, "rope_theta: must be a finite number > 0, got -1.0"),
        ("hc_sinkhorn_iters", -1, "hc_sinkhorn_iters: must be >= 1, got -1"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps: must be a finite number > 0, got nan"),
        ("vocab_size", 0, "vocab_size: must be >= 1, got 0"),
        ("qk_rope_head_dim", 130, "qk_rope_head_dim: must be <= head_dim"),
        ("candidate_source_layer_id", 99, "candidate_source_layer_id: must be -1"),
        ("compress_ratios", [-4] * 8, "compress_ratios: must be >= 0 each"),
    ],
)
def test_out_of_range_values_name_the_key(key, value, message):
    """Issue 33.8: every value's range is checked in ModelConfig (0 heads were a ZeroDivisionError
    traceback, a negative top-k or a NaN epsilon converted with exit 0)."""
    raw = copy.deepcopy(_raw())
    assert raw["text_config"]["n_routed_experts"] == 8 and raw["text_config"]["head_dim"] == 128
    raw["text_config"][key] = value
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_config(raw)
    assert message in str(e.value)
