"""The checkpoint inventory against published numbers (spec 4.3 / 5.1-5.4, the mid README) and
against the golden tiny-a checkpoint's own headers."""

from __future__ import annotations

import json
from collections import Counter

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from ced_jax.checkpoint.mapping import (
    STORAGE_DTYPES,
    hf_inventory,
    optional_group_of,
    our_param_specs,
    our_target,
    parameter_counts,
)
from ced_jax.config import ModelConfig, preset
from tests.conftest import GOLDEN_TINY_A, REPO


@pytest.fixture(scope="module")
def flash() -> dict:
    return hf_inventory(preset("v41-flash"))


def test_v41_flash_tensor_count(flash):
    assert len(flash) == 96_085
    groups = Counter(s.group for s in flash.values())
    assert groups == {"backbone": 93_414, "engram_table": 4, "dspark": 2_401, "vision": 266}

    # Spec 5.4's census splits the layers (Engram tensors and globals counted apart).
    def layer_count(lo: int, hi: int) -> int:
        return sum(
            1
            for n in flash
            if n.startswith("layers.") and lo <= int(n.split(".")[1]) < hi and ".engram." not in n
        )

    assert layer_count(0, 20) == 46_704
    assert layer_count(20, 40) == 46_699


def test_v41_flash_parameter_counts():
    counts = parameter_counts(preset("v41-flash"))
    assert counts == {
        "backbone": 551_880_835_184,
        "engram_table": 196_613_849_600,
        "dspark": 14_225_362_530,
        "vision": 485_268_480,
        "total": 763_205_315_794,
    }


def test_v41_flash_routed_experts_and_bytes(flash):
    experts = sum(s.params for n, s in flash.items() if n.startswith("layers.") and ".ffn.experts." in n)
    assert experts == 543_581_798_400
    # Spec 5.1: payload bytes of the release; 5.2: storage by dtype (3-4 significant digits).
    assert sum(s.nbytes for s in flash.values()) == 510_286_023_000
    by_dtype = Counter()
    for s in flash.values():
        by_dtype[s.dtype] += s.nbytes
    published = {"BF16": 3.95e9, "F32": 1.69e8, "F8_E4M3": 2.040e11, "F8_E8M0": 2.356e10, "I8": 2.786e11}
    for dtype, value in published.items():
        assert by_dtype[dtype] == pytest.approx(value, rel=2e-3), dtype


def test_v41_flash_shapes_from_spec_table(flash):
    expected = {
        "layers.0.attn.wq_a.weight": ("F8_E4M3", (1280, 5120)),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", (40, 160)),
        "layers.0.attn.wq_b.scale": ("F8_E8M0", (1024, 40)),
        "layers.0.attn.wo_a.weight": ("F8_E4M3", (8192, 4096)),
        "layers.0.attn.wo_a.scale": ("F8_E8M0", (256, 128)),
        "layers.0.attn.wo_b.scale": ("F8_E8M0", (160, 256)),
        "layers.0.attn.attn_sink": ("F32", (64,)),
        "layers.0.hc_attn_fn": ("F32", (24, 20480)),
        "layers.0.ffn.gate.bias_vl": ("F32", (384,)),
        "layers.0.ffn.experts.383.w1.weight": ("I8", (2304, 2560)),
        "layers.0.ffn.experts.383.w1.scale": ("F8_E8M0", (2304, 160)),
        "layers.0.ffn.experts.0.w2.weight": ("I8", (5120, 1152)),
        "layers.0.ffn.experts.0.w2.scale": ("F8_E8M0", (5120, 72)),
        "layers.0.ffn.shared_experts.w2.scale": ("F8_E8M0", (160, 72)),
        "layers.14.engram.embed.weight": ("F8_E4M3", (384016682, 256)),
        "layers.1.engram.embed.scale": ("F8_E8M0", (384006168, 8)),
        "layers.1.engram.wkv.scale": ("F8_E8M0", (800, 192)),
        "layers.1.engram.q_weight": ("BF16", (4, 5120)),
        "layers.20.attn.compressor.wkv.weight": ("BF16", (512, 5120)),
        "layers.24.attn.indexer.wq_b.scale": ("F8_E8M0", (128, 40)),
        "layers.20.attn.indexer.wk.weight": ("BF16", (128, 512)),
        "embed.weight": ("BF16", (129280, 5120)),
        "mtp.0.main_proj.scale": ("F8_E8M0", (160, 480)),
        "mtp.2.markov_head.head.weight": ("BF16", (129280, 256)),
        "mtp.2.confidence_head.proj.weight": ("BF16", (1, 5376)),
        "mtp.1.ffn.gate.weight": ("BF16", (128, 5120)),
        "vision.patch_embed.proj.weight": ("BF16", (1024, 588)),
        "vision.blocks.31.mlp.w1.weight": ("BF16", (5632, 1024)),
        "aligner.w1.weight": ("BF16", (5120, 9216)),
        "image_newline": ("BF16", (5120,)),
    }
    for name, (dtype, shape) in expected.items():
        assert (flash[name].dtype, flash[name].shape) == (dtype, shape), name
    # Compressor gates only at ratio 2; index keys only on KV sources; no hc_head, no mtp.1.norm.
    assert {n for n in flash if n.endswith("compressor.wgate.weight")} == {
        f"layers.{i}.attn.compressor.wgate.weight" for i in (2, 8, 14)
    }
    assert {n for n in flash if n.endswith("indexer.wk.weight")} == {
        f"layers.{i}.attn.indexer.wk.weight" for i in (2, 8, 14, 20)
    }
    assert not [n for n in flash if "hc_head" in n]
    assert "mtp.1.norm.weight" not in flash and "mtp.2.norm.weight" in flash


def test_mid_inventory_matches_readme():
    cfg = ModelConfig.from_pretrained(REPO / "bench" / "configs" / "mid")
    inv = hf_inventory(cfg)
    assert len(inv) == 6417
    assert sum(s.nbytes for s in inv.values()) == 939_003_956
    experts = [s for n, s in inv.items() if ".ffn.experts." in n]
    assert len(experts) == 6144 and sum(s.nbytes for s in experts) == pytest.approx(855.64e6, abs=0.005e6)
    tables = [s for s in inv.values() if s.group == "engram_table"]
    assert sum(s.nbytes for s in tables) == (120754 + 121928) * (64 + 2)  # FP8 rows + 2 scales per row
    assert inv["layers.2.engram.embed.weight"].shape == (121928, 64)
    assert inv["layers.1.engram.wkv.weight"].shape == (5120, 768)


def test_tiny_a_inventory_equals_its_index_and_headers():
    cfg = ModelConfig.from_pretrained(GOLDEN_TINY_A)
    inv = hf_inventory(cfg)
    index = json.loads((GOLDEN_TINY_A / "model.safetensors.index.json").read_text())
    assert set(inv) == set(index["weight_map"])
    found = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(GOLDEN_TINY_A / file), framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                found[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    assert found == {n: (s.dtype, s.shape) for n, s in inv.items()}
    assert sum(s.nbytes for s in inv.values()) == index["metadata"]["total_size"]
    # The same model as the tiny preset; only the Engram compressed vocab differs, a property of the
    # tokenizer (tiny ships a byte-level BPE, tiny-a a word-level stand-in), and tiny adds DSpark
    # stages (tiny-a has none, so its dspark_* fields are placeholders).
    tiny = preset("tiny")
    dspark_fields = {f: getattr(tiny, f) for f in tiny.__dataclass_fields__ if f.startswith("dspark_")}
    assert cfg.num_nextn_predict_layers == 0 < tiny.num_nextn_predict_layers
    same = cfg.replace(
        engram_compressed_vocab_size=tiny.engram_compressed_vocab_size,
        num_nextn_predict_layers=tiny.num_nextn_predict_layers,
        **dspark_fields,
    )
    assert same == tiny


def test_parameter_convention_packed_fp4_and_scales():
    inv = hf_inventory(preset("tiny"))
    w = inv["layers.0.ffn.experts.0.w1.weight"]
    assert w.shape == (128, 128) and w.logical_shape == (128, 256) and w.params == 128 * 256
    s = inv["layers.0.ffn.experts.0.w1.scale"]
    assert s.is_scale and s.params == 0 and s.weight_name == "layers.0.ffn.experts.0.w1.weight"
    assert inv["layers.0.attn.wq_a.scale"].params == 0


def test_our_targets():
    t = our_target("layers.3.ffn.experts.17.w2.scale")
    assert (t.path, t.kind, t.expert) == ("layers.3.ffn.experts.w2.scale", "stack", 17)
    t = our_target("layers.3.attn.wo_a.weight")
    assert (t.path, t.kind) == ("layers.3.attn.wo_a.weight", "wo_a")
    t = our_target("layers.3.attn.wo_a.scale")
    assert (t.path, t.kind) == ("layers.3.attn.wo_a.weight", "wo_a_scale")
    assert our_target("layers.3.ffn.shared_experts.w1.weight").kind == "copy"
    assert our_target("layers.1.engram.embed.scale").path == "layers.1.engram.embed.scale"
    assert optional_group_of("mtp.0.attn.wq_a.weight") == "dspark"
    assert optional_group_of("aligner.w1.bias") == "vision"
    assert optional_group_of("image_start") == "vision"
    assert optional_group_of("layers.0.attn.wq_a.weight") is None


def test_our_param_specs_tiny():
    cfg = preset("tiny")
    specs = our_param_specs(cfg)
    assert specs["layers.0.ffn.experts.w1.weight"] == ((8, 128, 128), np.dtype(np.uint8))
    assert specs["layers.0.ffn.experts.w2.scale"] == ((8, 256, 4), np.dtype(np.uint8))
    assert specs["layers.0.attn.wo_a.weight"] == ((128, 256), np.dtype(ml_dtypes.bfloat16))
    assert "layers.0.attn.wo_a.scale" not in specs
    assert specs["layers.0.attn.wq_a.weight"][1] == np.dtype(ml_dtypes.float8_e4m3fn)
    assert specs["layers.0.attn.wq_a.scale"][1] == np.dtype(np.uint8)
    assert specs["embed.weight"] == ((512, 256), np.dtype(ml_dtypes.bfloat16))
    assert specs["layers.0.hc_attn_fn"][1] == np.dtype(np.float32)
    assert not [p for p in specs if ".experts." in p and p.split(".")[4].isdigit()]
    # 657 HF tensors - 8 layers x (8 experts x 6 - 6 stacked) - 8 consumed wo_a scales
    assert len(specs) == 657 - 8 * 42 - 8
    assert "layers.1.engram.embed.weight" not in our_param_specs(cfg, ("backbone",))
    assert not [p for p in specs if p.startswith("mtp.")]  # the text groups only, by default
    # DSpark stages stack their own expert set (tiny: 4 against the backbone's 8).
    draft = our_param_specs(cfg, ("dspark",))
    assert cfg.dspark_n_routed_experts != cfg.n_routed_experts
    assert draft["mtp.1.ffn.experts.w2.weight"][0] == (cfg.dspark_n_routed_experts, 256, 64)
    assert draft["mtp.0.attn.wo_a.weight"][1] == np.dtype(ml_dtypes.bfloat16)
    assert all(p.startswith("mtp.") for p in draft)
    with pytest.raises(ValueError, match="not implemented"):
        our_param_specs(preset("v41-flash"), ("backbone", "vision"))


def _mapped_inventory(cfg: ModelConfig) -> dict:
    """The released file's tensors (`hf_inventory`) mapped to our paths by name alone: experts
    stacked, `wo_a` dequantised to bf16 (its scale consumed), vision left out."""
    out = {}
    for spec in hf_inventory(cfg).values():
        if spec.group == "vision":
            continue
        target = our_target(spec.name)
        dtype = STORAGE_DTYPES[spec.dtype]
        if target.kind == "copy":
            out[target.path] = (spec.shape, dtype)
        elif target.kind == "stack":
            count = cfg.dspark_n_routed_experts if target.path.startswith("mtp.") else cfg.n_routed_experts
            out[target.path] = ((count, *spec.shape), dtype)
        elif target.kind == "wo_a":
            out[target.path] = (spec.shape, np.dtype(ml_dtypes.bfloat16))
    return out


@pytest.mark.parametrize("source", ["tiny", "v41-flash", "tiny-a", "tiny-v", "tiny-v2", "assets-tiny"])
def test_model_tree_matches_the_released_inventory(source):
    """Two independent descriptions of the weights agree: the model's abstract tree (from which
    `our_param_specs`, the loaders, the shardings and the planner derive) and the inventory of the
    released checkpoint's files, mapped by name."""
    files = {
        "tiny-a": GOLDEN_TINY_A,
        "tiny-v": REPO / "tests/golden/tiny-v",
        "tiny-v2": REPO / "tests/golden/tiny-v2",
        "assets-tiny": REPO / "ced_jax/assets/tiny",
    }
    if source in files:
        cfg = ModelConfig.from_hf_config(json.loads((files[source] / "config.json").read_text()))
    else:
        cfg = preset(source)
    assert our_param_specs(cfg, ("backbone", "engram_table", "dspark")) == _mapped_inventory(cfg)
