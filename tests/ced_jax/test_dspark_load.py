"""`ced_jax.load(..., with_draft=None|True|False)`: the DSpark draft stages under `Model.params["mtp"]`.

Every source must give the same tree as `ced_jax.checkpoint.dspark.load_dspark_params` on the same stages
(names, dtypes, bytes): a released-layout HF directory (the vision/DSpark fixture, `--vision-golden
DIR`, whose stages have their own expert count, 6 against the backbone's 8), its `convert_weights
--include text,dspark` output, and the tiny preset (a synthetic checkpoint written from the preset's
own seed is the same source). A shipped trained draft file replaces the tiny preset's random stages.
with_draft=True on a checkpoint without stages names what is missing; with_draft=False skips them; a
checkpoint without stages loads as before (Model.has_draft_stages False).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import ced_jax
from ced_jax.checkpoint.converted import MANIFEST_NAME
from ced_jax.checkpoint.dspark import load_dspark_params
from ced_jax.checkpoint.hf_loader import INDEX_NAME, CheckpointError, load_hf_checkpoint
from ced_jax.checkpoint.mapping import hf_inventory
from ced_jax.config import ModelConfig, preset
from ced_jax.sharding import make_mesh
from ced_jax.testing.random_weights import (
    TINY_DSPARK_FILE,
    TINY_SEED,
    iter_hf_tensors,
    random_params,
    tiny_dspark_params,
)
from ced_jax.training.dspark_train import save_dspark_safetensors
from ced_jax.trees import flatten, nest
from conversion.convert import ConvertOptions, convert
from conversion.synthetic import FILE_DTYPES, write_synthetic_checkpoint
from tests.conftest import GOLDEN_TINY_A


def assert_same_tree(got: dict, expected: dict) -> None:
    """Same leaves, dtypes, shapes and bytes."""
    got, expected = flatten(got), flatten(expected)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        a, b = np.asarray(got[name]), np.asarray(want)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        assert a.tobytes() == b.tobytes(), name


@pytest.fixture(scope="module")
def fixture_dir(request) -> Path:
    path = Path(request.config.getoption("vision_golden"))
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.num_nextn_predict_layers > 0, f"{path}: the DSpark fixture must have DSpark stages"
    return path


@pytest.fixture(scope="module")
def fixture_stages(fixture_dir) -> dict:
    return load_dspark_params(fixture_dir, ModelConfig.from_pretrained(fixture_dir))["mtp"]


# ------------------------------------------------------------------------------ HF directory
def test_hf_directory_loads_the_stages(fixture_dir, fixture_stages):
    cfg = ModelConfig.from_pretrained(fixture_dir)
    model = ced_jax.load(fixture_dir)
    assert model.has_draft_stages
    assert_same_tree(model.params["mtp"], fixture_stages)
    # The stages' routed experts are their own set, stacked over dspark_n_routed_experts.
    w1 = model.params["mtp"]["0"]["ffn"]["experts"]["w1"]["weight"]
    assert w1.shape[0] == cfg.dspark_n_routed_experts
    assert model.params["layers"]["0"]["ffn"]["experts"]["w1"]["weight"].shape[0] == cfg.n_routed_experts
    # with_draft=True gives the same; with_draft=False skips the stages and leaves the rest as it was.
    assert_same_tree(ced_jax.load(fixture_dir, with_draft=True).params["mtp"], fixture_stages)
    without = ced_jax.load(fixture_dir, with_draft=False)
    assert not without.has_draft_stages and "mtp" not in without.params
    assert_same_tree(without.params, {k: v for k, v in model.params.items() if k != "mtp"})


def _copy_with_index(src: Path, dst: Path, keep) -> Path:
    """A copy of checkpoint `src` whose index lists only the tensors `keep(name)` accepts (the
    shard files themselves unchanged), as a deployment that strips tensors would leave it."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_NAME).read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if keep(n)}
    index.pop("metadata", None)
    (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def test_hf_directory_without_the_stage_tensors(fixture_dir, tmp_path):
    stripped = _copy_with_index(fixture_dir, tmp_path / "stripped", lambda n: not n.startswith("mtp."))
    # None: the config describes stages, the tensors are gone.
    assert not ced_jax.load(stripped).has_draft_stages
    with pytest.raises(CheckpointError, match=r"with_draft=True.*mtp\.0\."):
        ced_jax.load(stripped, with_draft=True)
    # A partial set is a broken checkpoint, whatever with_draft says (except False, which never looks).
    # The final norm is the last stage's alone (mtp.1 of tiny-v's two, mtp.2 of three: issue 37).
    victim = f"mtp.{ModelConfig.from_pretrained(fixture_dir).num_nextn_predict_layers - 1}.norm.weight"
    assert victim in json.loads((fixture_dir / INDEX_NAME).read_text())["weight_map"]
    partial = _copy_with_index(fixture_dir, tmp_path / "partial", lambda n: n != victim)
    for with_draft in (None, True):
        with pytest.raises(CheckpointError, match=re.escape(victim)):
            ced_jax.load(partial, with_draft=with_draft)
    assert not ced_jax.load(partial, with_draft=False).has_draft_stages


def test_checkpoint_without_stages():
    """tiny-a describes no DSpark stages: it loads as before, and with_draft=True names the field."""
    model = ced_jax.load(GOLDEN_TINY_A)
    assert not model.has_draft_stages and "mtp" not in model.params
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        ced_jax.load(GOLDEN_TINY_A, with_draft=True)
    cfg = ModelConfig.from_pretrained(GOLDEN_TINY_A)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        load_hf_checkpoint(GOLDEN_TINY_A, cfg, include=("text", "dspark"))
    with pytest.raises(ValueError, match="with_draft"):
        ced_jax.load(GOLDEN_TINY_A, with_draft="yes")


# ------------------------------------------------------------------------ converted directory
def test_converted_directory(fixture_dir, fixture_stages, tmp_path):
    out = tmp_path / "converted"
    convert(fixture_dir, out, ConvertOptions(progress=False, include=("text", "dspark")))
    model = ced_jax.load(out)
    assert model.has_draft_stages
    assert_same_tree(model.params["mtp"], fixture_stages)
    assert not ced_jax.load(out, with_draft=False).has_draft_stages
    # The same conversion written without its dspark part (manifest and items as a text-only run
    # leaves them): None loads the text model, True says how to convert.
    text_only = tmp_path / "text-only"
    shutil.copytree(out, text_only)
    shutil.rmtree(text_only / "dspark")
    manifest = json.loads((text_only / MANIFEST_NAME).read_text())
    manifest["options"]["include"] = ["text"]
    manifest["items"].pop("dspark")
    manifest["leaves"] = {k: v for k, v in manifest["leaves"].items() if not k.startswith("mtp.")}
    (text_only / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert not ced_jax.load(text_only).has_draft_stages
    with pytest.raises(CheckpointError, match="--include text,dspark"):
        ced_jax.load(text_only, with_draft=True)


# ----------------------------------------------------------------------------------- tiny preset
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny preset written out as a released-layout checkpoint from its own seed."""
    out = tmp_path_factory.mktemp("tiny-hf")
    write_synthetic_checkpoint(preset("tiny"), out, seed=TINY_SEED)
    return out


def test_tiny_preset_stages(tiny_checkpoint):
    cfg = preset("tiny")
    assert cfg.num_nextn_predict_layers > 0
    model = ced_jax.load("tiny")
    assert model.has_draft_stages
    # The preset's stages are the shipped trained draft (assets/tiny/dspark.safetensors) when it is
    # there, else the random ones the synthetic checkpoint holds.
    if TINY_DSPARK_FILE.is_file():
        assert_same_tree({"mtp": model.params["mtp"]}, tiny_dspark_params(TINY_DSPARK_FILE))
    else:
        assert_same_tree(model.params["mtp"], load_dspark_params(tiny_checkpoint, cfg)["mtp"])
    # The noise id is a special token of the tiny tokenizer (no text decodes to it), as in v41-flash.
    assert model.tokenizer.id_to_token(cfg.dspark_noise_token_id) == "<｜System｜>"
    assert model.decode_text([cfg.dspark_noise_token_id]) == ""
    without = ced_jax.load("tiny", with_draft=False)
    assert not without.has_draft_stages
    assert_same_tree(without.params, {k: v for k, v in model.params.items() if k != "mtp"})


def test_old_spellings_warn_and_still_work():
    """`load(dspark=...)` and `Model.dspark`, the names before with_draft / has_draft_stages (dspark
    is the number of drafts per step everywhere else), still work with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="with_draft"):
        without = ced_jax.load("tiny", dspark=False)
    with pytest.warns(DeprecationWarning, match="has_draft_stages"):
        assert without.dspark is False
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="both"):
        ced_jax.load("tiny", dspark=False, with_draft=False)
    with pytest.raises(TypeError, match="'draft'"):
        ced_jax.load("tiny", draft=False)


def test_tiny_preset_stages_on_a_mesh():
    model = ced_jax.load("tiny", mesh=make_mesh({"expert": 4, "tensor": 2}))
    plain = ced_jax.load("tiny")
    assert_same_tree(model.params["mtp"], plain.params["mtp"])
    for leaf in jax.tree.leaves(model.params["mtp"]):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8


def _write_dspark_file(path: Path, cfg: ModelConfig, seed: int, drop: str | None = None) -> None:
    """A trained-draft file as shipped: the released mtp.* names and dtypes in one safetensors file."""
    inventory = hf_inventory(cfg)
    names = [n for n, s in inventory.items() if s.group == "dspark" and n != drop]
    tensors = {n: a.view(FILE_DTYPES[inventory[n].dtype]) for n, a in iter_hf_tensors(cfg, seed, names)}
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_tiny_dspark_file_replaces_the_random_stages(tmp_path):
    cfg = preset("tiny")
    random_stages = tiny_dspark_params(tmp_path / "absent.safetensors")
    assert random_stages.keys() == random_params(cfg, TINY_SEED, ("dspark",)).keys()
    path = tmp_path / "dspark.safetensors"
    _write_dspark_file(path, cfg, seed=99)
    shipped = tiny_dspark_params(path)
    expected = random_params(cfg, 99, ("dspark",))
    assert_same_tree(shipped, expected)
    assert shipped["mtp.0.main_proj.weight"].tobytes() != random_stages["mtp.0.main_proj.weight"].tobytes()
    # A file that lacks a stage tensor is refused by name.
    bad = tmp_path / "bad.safetensors"
    _write_dspark_file(bad, cfg, seed=99, drop="mtp.1.markov_head.embed.weight")
    with pytest.raises(CheckpointError, match=r"mtp\.1\.markov_head\.embed\.weight"):
        tiny_dspark_params(bad)


def test_trained_draft_file_round_trips(tmp_path):
    """What the training path ships (`dspark_train.save_dspark_safetensors` of a storage tree) is what
    `tiny_dspark_params` reads back: the same params, `attn.wo_a` (bf16 in our tree, FP8 in the
    file) included."""
    cfg = preset("tiny")
    stages = random_params(cfg, 5, ("dspark",))
    path = save_dspark_safetensors(nest(stages), cfg, tmp_path / "dspark.safetensors")
    assert_same_tree(tiny_dspark_params(path), stages)
