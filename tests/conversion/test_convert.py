"""convert_weights on the golden tiny-a checkpoint: the good path (layouts, manifest, describe, restore
on another mesh, logits bit for bit) and every failure mode on corrupted copies, each of which must
exit non-zero naming the tensor or file and leave no output (nor temporary) directory behind.

The converter writes host numpy arrays from one process (no device placement), i.e. "written on one
device"; the restore tests read it back onto a (expert=4, tensor=2) mesh of the 8 fake CPU devices."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ced_cli.main import convert_main, main
from ced_jax.checkpoint.converted import MANIFEST_NAME, load_flat, restore, target_specs
from ced_jax.checkpoint.hf_loader import CheckpointError, iter_raw_tensors, load_hf_checkpoint
from ced_jax.checkpoint.mapping import hf_inventory, our_target
from ced_jax.config import ModelConfig, VisionConfig, preset
from ced_jax.model import flatten_specs, param_specs
from ced_jax.sharding import make_mesh
from ced_jax.trees import flatten
from conversion.convert import ConversionError, ConvertOptions, convert
from conversion.outdir import OWNER_MARKER
from conversion.synthetic import write_synthetic_checkpoint
from pallas_kernels.formats import FP4_TABLE, np_dequant_fp8_weight
from tests.conftest import GOLDEN_TINY_A, REPO

SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
INDEX = "model.safetensors.index.json"
SIDE_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "engram_token_map.json"]
NP_OF = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I8": np.int8,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
}
QUIET = ConvertOptions(progress=False)


# ---------------------------------------------------------------------- helpers
def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes), straight from the safetensors layout."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]])
        for k, v in header.items()
    }


def rewrite_shard(path: Path, change) -> None:
    arrays = {k: np.frombuffer(b, NP_OF[d]).reshape(s) for k, (d, s, b) in raw_tensors(path).items()}
    change(arrays)
    save_file(arrays, str(path), metadata={"format": "pt"})


def edit_index(ckpt: Path, change) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    change(index["weight_map"])
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def ckpt(tmp_path) -> Path:
    src = tmp_path / "hf"
    src.mkdir()
    for name in [*SHARDS, INDEX, *SIDE_FILES]:
        shutil.copyfile(GOLDEN_TINY_A / name, src / name)
    return src


def run_cli(src: Path, out: Path, *extra: str) -> int:
    return convert_main(["--hf-dir", str(src), "--out", str(out), "--quiet", *extra])


def assert_fails(src: Path, out: Path, capsys, *needles: str, extra=()) -> str:
    """convert_weights exits 2 with one error line naming all `needles`, and leaves nothing behind."""
    before = sorted(p.name for p in out.parent.iterdir())
    assert run_cli(src, out, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_weights: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == before  # no temporary directory either
    return err


# ---------------------------------------------------------------------- the good path
@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("conv") / "tiny-a"
    summary = convert(GOLDEN_TINY_A, out, QUIET)
    return out, summary


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_pretrained(GOLDEN_TINY_A)


@pytest.fixture(scope="module")
def hf_params(cfg):
    return load_hf_checkpoint(GOLDEN_TINY_A, cfg)[0]


def test_layout_manifest_and_coverage(converted, cfg):
    out, summary = converted
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["params", "engram", "engram_raw", MANIFEST_NAME, *SIDE_FILES]
    )
    for name in SIDE_FILES:
        assert (out / name).read_bytes() == (GOLDEN_TINY_A / name).read_bytes()
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["options"] == {
        "include": ["text"],
        "engram": "separate",
        "weights_dtype": "native",
        "compression": True,
    }
    assert m["converter"]["version"] and m["format_version"] == 1
    sources = {s["file"]: s for s in m["sources"]}
    assert set(sources) == {*SHARDS, INDEX, *SIDE_FILES}
    for name, s in sources.items():
        assert (
            s["sha256"] == sha256(GOLDEN_TINY_A / name)
            and s["bytes"] == (GOLDEN_TINY_A / name).stat().st_size
        )
    # Every source tensor consumed (none ignored here), every leaf of the model produced, as specified.
    assert m["tensors"]["source"] == m["tensors"]["consumed"] == 657 and m["tensors"]["ignored"] == []
    assert sorted(m["tensors"]["folded_scales"]) == sorted(f"layers.{i}.attn.wo_a.scale" for i in range(8))
    specs = flatten_specs(param_specs(cfg))
    assert set(m["leaves"]) == set(specs)
    for path, leaf in m["leaves"].items():
        assert leaf["shape"] == list(specs[path].shape) and leaf["dtype"] == str(np.dtype(specs[path].dtype))
        assert leaf["item"] == ("engram" if ".engram.embed." in path else "params")
    assert summary["leaves"] == len(specs) and summary["consumed"] == 657


def test_describe_matches_source(converted, capsys):
    out, _ = converted
    assert main(["describe", str(GOLDEN_TINY_A)]) == 0
    source = json.loads(capsys.readouterr().out)
    assert main(["describe", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == source


def test_load_flat_is_bit_identical_to_the_hf_loader(converted, hf_params):
    out, _ = converted
    _, flat = load_flat(out)
    assert set(flat) == set(hf_params)
    for name, ref in hf_params.items():
        assert flat[name].dtype == ref.dtype and flat[name].shape == ref.shape, name
        assert flat[name].tobytes() == ref.tobytes(), name


def test_restore_onto_another_mesh(converted, cfg, hf_params):
    import jax

    from ced_jax.sharding import EP_TP_RULES, make_mesh, param_shardings

    out, _ = converted
    mesh = make_mesh({"expert": 4, "tensor": 2})
    r = restore(out, mesh=mesh, rules=EP_TP_RULES)
    want = param_shardings(param_specs(cfg), mesh, EP_TP_RULES)
    got = r.params
    experts = got["layers"]["3"]["ffn"]["experts"]["w2"]["weight"]
    assert experts.sharding.spec == want["layers"]["3"]["ffn"]["experts"]["w2"]["weight"].spec
    assert tuple(experts.sharding.spec)[:2] == ("expert", "tensor")
    assert {s.data.shape for s in experts.addressable_shards} == {(2, 128, 64)}  # 8 experts / 4, 256 / 2
    flat = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(got)
    want_flat = flatten_specs(want)
    assert set(flat) == {p for p in hf_params if ".engram.embed." not in p}
    for name, arr in flat.items():
        assert isinstance(arr, jax.Array) and arr.sharding == want_flat[name], name
        assert np.asarray(arr).tobytes() == hf_params[name].tobytes(), name
    # The separate Engram item stays in host memory.
    table = r.engram["layers"]["1"]["engram"]["embed"]["weight"]
    assert (
        isinstance(table, np.ndarray)
        and table.tobytes() == hf_params["layers.1.engram.embed.weight"].tobytes()
    )


def test_logits_on_converted_equal_hf_bit_for_bit(converted, tmp_path):
    out, _ = converted
    g = load_file(str(GOLDEN_TINY_A / "expected.safetensors"))
    (tmp_path / "prompt.json").write_text(json.dumps(g["prompt_ids"][:24].tolist()))
    (tmp_path / "decode.json").write_text(json.dumps(g["decode_ids"][:2].tolist()))
    results = []
    for model in (GOLDEN_TINY_A, out):
        dest = tmp_path / f"{len(results)}.safetensors"
        args = [
            "logits",
            str(model),
            "--prompt-ids",
            str(tmp_path / "prompt.json"),
            "--decode-ids",
            str(tmp_path / "decode.json"),
            "--out",
            str(dest),
        ]
        assert main(args) == 0
        results.append(load_file(str(dest)))
    for key in ("prefill_logits_full", "decode_logits"):
        assert results[0][key].shape == results[1][key].shape
        assert results[0][key].tobytes() == results[1][key].tobytes(), key


def test_engram_inline_and_skip(tmp_path, hf_params):
    inline = tmp_path / "inline"
    convert(GOLDEN_TINY_A, inline, ConvertOptions(progress=False, engram="inline"))
    assert not (inline / "engram").exists()
    _, flat = load_flat(inline)
    assert flat["layers.2.engram.embed.scale"].tobytes() == hf_params["layers.2.engram.embed.scale"].tobytes()
    skip = tmp_path / "skip"
    summary = convert(GOLDEN_TINY_A, skip, ConvertOptions(progress=False, engram="skip"))
    m = json.loads((skip / MANIFEST_NAME).read_text())
    assert [i["name"] for i in m["tensors"]["ignored"]] == sorted(
        f"layers.{i}.engram.embed.{p}" for i in (1, 2) for p in ("scale", "weight")
    )
    assert all("--engram skip" in i["reason"] for i in m["tensors"]["ignored"])
    assert summary["leaves"] == len(hf_params) - 4
    with pytest.raises(CheckpointError, match="--engram skip"):
        load_flat(skip)


def test_uncompressed_is_ocdbt_and_restores_the_same(converted, tmp_path, hf_params):
    """Compressed checkpoints are plain zarr3 (OCDBT would hold every encoded chunk of a save until
    its commit), uncompressed ones OCDBT; both restore to the source bytes."""
    out, _ = converted
    plain = tmp_path / "plain"
    convert(GOLDEN_TINY_A, plain, ConvertOptions(progress=False, compression=False))
    assert json.loads((plain / MANIFEST_NAME).read_text())["options"]["compression"] is False
    assert list(plain.glob("params/**/manifest.ocdbt")) and not list(out.glob("params/**/manifest.ocdbt"))
    _, flat = load_flat(plain)
    assert set(flat) == set(hf_params)
    assert all(flat[k].tobytes() == v.tobytes() for k, v in hf_params.items())


def test_bf16_dequantises_everything_exactly(tmp_path, cfg, hf_params):
    out = tmp_path / "bf16"
    convert(GOLDEN_TINY_A, out, ConvertOptions(progress=False, weights_dtype="bf16"))
    r = restore(out)
    specs = target_specs(cfg, weights_dtype="bf16", engram="separate")
    assert not any(p.endswith(".scale") for p in specs)
    w = r.params["layers"]["3"]["ffn"]["experts"]["w2"]["weight"]
    assert w.dtype == ml_dtypes.bfloat16 and w.shape == (8, 256, 128)
    # Independent decode: e2m1 code table times 2^(e-127) per 32 inputs.
    packed = hf_params["layers.3.ffn.experts.w2.weight"]
    scale = hf_params["layers.3.ffn.experts.w2.scale"].astype(np.float64)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(8, 256, 128)
    expected = FP4_TABLE[codes].astype(np.float64) * np.repeat(2.0 ** (scale - 127), 32, axis=-1)
    np.testing.assert_array_equal(w.astype(np.float64), expected)
    q = r.params["layers"]["0"]["attn"]["wq_a"]["weight"]
    ref_w = hf_params["layers.0.attn.wq_a.weight"].astype(np.float64)
    ref_s = hf_params["layers.0.attn.wq_a.scale"].astype(np.float64)
    np.testing.assert_array_equal(
        q.astype(np.float64), ref_w * np.kron(2.0 ** (ref_s - 127), np.ones((32, 32)))
    )
    table = r.engram["layers"]["2"]["engram"]["embed"]["weight"]
    t_w = hf_params["layers.2.engram.embed.weight"].astype(np.float64)
    t_s = hf_params["layers.2.engram.embed.scale"].astype(np.float64)
    np.testing.assert_array_equal(table.astype(np.float64), t_w * np.repeat(2.0 ** (t_s - 127), 32, axis=1))
    with pytest.raises(CheckpointError, match="weights-dtype bf16"):
        load_flat(out)


def test_ignored_optional_tensors_are_listed_and_hashed(ckpt, tmp_path):
    extra = "model-extra.safetensors"
    save_file(
        {
            "mtp.0.attn.wq_a.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn),
            "vision.norm.weight": np.ones(8, ml_dtypes.bfloat16),
        },
        str(ckpt / extra),
    )
    edit_index(ckpt, lambda wm: wm.update({"mtp.0.attn.wq_a.weight": extra, "vision.norm.weight": extra}))
    out = tmp_path / "out"
    assert run_cli(ckpt, out) == 0
    m = json.loads((out / MANIFEST_NAME).read_text())
    reasons = {i["name"]: i["reason"] for i in m["tensors"]["ignored"]}
    assert set(reasons) == {"mtp.0.attn.wq_a.weight", "vision.norm.weight"}
    assert "DSpark" in reasons["mtp.0.attn.wq_a.weight"] and "vision" in reasons["vision.norm.weight"]
    assert m["tensors"]["consumed"] + len(reasons) == m["tensors"]["source"] == 659
    assert {s["file"]: s["sha256"] for s in m["sources"]}[extra] == sha256(ckpt / extra)


def test_progress_bar_shows_tensors_and_bytes(ckpt, tmp_path, capsys):
    assert convert_main(["--hf-dir", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    total = sum((ckpt / f).stat().st_size for f in [*SHARDS])
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "tensors 657/657, done" in last, last
    assert f"{total / 2**20:.1f}M/{total / 2**20:.1f}M" in last, (total, last)


def test_out_below_a_file_is_named(ckpt, tmp_path, capsys):
    """Issue 33.8: `--out FILE/sub` said only "File exists"."""
    (tmp_path / "FILE").write_text("x")
    assert run_cli(ckpt, tmp_path / "FILE" / "sub") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'FILE'} is a file, not a directory" in err and err.count("\n") == 1, err
    assert (tmp_path / "FILE").read_text() == "x"


def test_existing_output_needs_overwrite(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert run_cli(ckpt, out) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert run_cli(ckpt, out, "--overwrite") == 0  # an empty directory holds nothing to lose
    first = (out / MANIFEST_NAME).read_text()
    (out / "left-by-the-first.txt").write_text("inside a previous conversion")
    assert run_cli(ckpt, out, "--overwrite") == 0  # a previous conversion is replaced whole
    assert not (out / "left-by-the-first.txt").exists() and (out / MANIFEST_NAME).read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]  # the replaced copy is gone


# ---------------------------------------------------------------------- never destroy what it did not write
def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("convert_weights: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every file and directory under `path` (a file: its bytes)."""
    return {
        str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))
    }


@pytest.mark.parametrize("out", ["", "   "])
def test_empty_out_is_refused(ckpt, tmp_path, monkeypatch, capsys, out):
    """`--out ""` is the working directory to pathlib: with --overwrite it used to be replaced by the
    checkpoint, deleting whatever was in it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("precious")
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    assert convert_main(["--hf-dir", str(ckpt), "--out", out, "--overwrite", "--quiet"]) == 2
    _one_error_line(capsys, "--out", "empty")
    assert _tree(tmp_path) == before


@pytest.fixture
def no_tensor_read(monkeypatch):
    """Fails the test if the conversion gets as far as planning (reading shard headers)."""
    import conversion.convert as conv

    def refuse(*args, **kwargs):
        raise AssertionError("the refusal must come before any checkpoint file is read")

    monkeypatch.setattr(conv, "make_plan", refuse)


def _previous_conversion_lookalike(directory: Path) -> None:
    """What --overwrite would replace: a directory holding a manifest of our format."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_NAME).write_text(json.dumps({"format": "ced-jax/orbax", "format_version": 1}))
    (directory / "precious.txt").write_text("not ours")


def test_overwrite_replaces_only_a_previous_conversion(ckpt, tmp_path, monkeypatch, capsys, no_tensor_read):
    """--overwrite refuses, naming the directory and before reading any tensor: a non-empty directory
    without a manifest, a file, the working directory, the home directory, a parent of --hf-dir,
    `/`, and --out inside --hf-dir; each target is left exactly as it was."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "keep.txt").write_text("precious")
    a_file = tmp_path / "a_file"
    a_file.write_text("precious")
    work = tmp_path / "work"
    _previous_conversion_lookalike(work)
    home = tmp_path / "home"
    _previous_conversion_lookalike(home)
    monkeypatch.setenv("HOME", str(home))  # Path.home(); the test must not point at the real one
    monkeypatch.chdir(work)
    cases = [
        (plain, "not a previous conversion"),
        (a_file, "not a directory"),
        (work, "the working directory"),
        (Path("."), "the working directory"),
        (home, "the home directory"),
        (tmp_path, "contains the source --hf-dir"),
        (Path("/"), "contains the source --hf-dir"),
        (ckpt, "inside the source --hf-dir"),
        (ckpt / "sub", "inside the source --hf-dir"),
    ]
    before = _tree(tmp_path)
    for out, needle in cases:
        assert run_cli(ckpt, out, "--overwrite") == 2, out
        _one_error_line(capsys, f"--out {out.resolve()}", needle)
        assert _tree(tmp_path) == before, out
    # The same refusals stand without --overwrite where the output does not exist yet.
    assert run_cli(ckpt, ckpt / "sub") == 2
    _one_error_line(capsys, "inside the source --hf-dir")


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o755), (0o077, 0o700)])
def test_output_directory_mode_follows_the_umask(ckpt, tmp_path, umask, mode):
    out = tmp_path / "out"
    previous = os.umask(umask)
    try:
        convert(ckpt, out, QUIET)
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == mode
    assert (out / "params").stat().st_mode & 0o777 == mode


def test_include_of_a_part_the_config_lacks_is_a_clear_error(ckpt, tmp_path, capsys):
    for part, needle in (("vision", "vision_config"), ("dspark", "num_nextn_predict_layers")):
        assert_fails(
            ckpt, tmp_path / "out", capsys, f"--include {part}", "config.json", needle,
            extra=("--include", f"text,{part}"),
        )  # fmt: skip
    assert_fails(ckpt, tmp_path / "out", capsys, "--include", "audio", extra=("--include", "text,audio"))


# ---------------------------------------------------------------------- DSpark and vision
@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> tuple[ModelConfig, Path]:
    """tiny with two DSpark stages and a two-block vision tower, synthetic weights (14 MB)."""
    cfg = preset("tiny").replace(
        name="tiny-mm",
        num_nextn_predict_layers=2,
        dspark_block_size=3,
        dspark_target_layer_ids=(1, 2),
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        vision=VisionConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=96, patch_size=4,
            rope_theta=10000.0, downsample_ratio=2, max_image_tokens=64, min_pixels=256,
        ),
    )  # fmt: skip
    src = tmp_path_factory.mktemp("mm") / "hf"
    write_synthetic_checkpoint(cfg, src, seed=11)
    return cfg, src


def test_include_dspark_and_vision(multimodal, tmp_path):
    """--include text,dspark,vision: each optional part is an Orbax item of its own (host memory), in
    the native formats (DSpark experts stacked per stage, wo_a dequantised as in the backbone),
    every byte as stored; the model's own leaves are the same as with --include text."""
    cfg, src = multimodal
    inv = hf_inventory(cfg)
    raw = dict(iter_raw_tensors(src))
    out = tmp_path / "all"
    convert(src, out, ConvertOptions(progress=False, include=("text", "dspark", "vision")))
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert set(m["items"]) == {"params", "engram", "dspark", "vision"}
    assert m["tensors"]["ignored"] == [] and m["tensors"]["consumed"] == m["tensors"]["source"] == len(inv)
    r = restore(out, mesh=make_mesh({"expert": 4, "tensor": 2}))
    assert set(r.parts) == {"dspark", "vision"}
    parts = {**flatten(r.parts["dspark"]), **flatten(r.parts["vision"])}
    assert all(isinstance(a, np.ndarray) for a in parts.values())
    optional = {n: s for n, s in inv.items() if s.group in ("dspark", "vision")}
    assert set(parts) == {our_target(n).path for n in optional if our_target(n).kind != "wo_a_scale"}
    for name, spec in optional.items():
        t = our_target(name)
        if t.kind == "wo_a_scale":
            assert name in m["tensors"]["folded_scales"]
            continue
        leaf = parts[t.path]
        assert m["leaves"][t.path]["item"] == spec.group
        if t.kind == "stack":
            assert leaf.shape == (cfg.dspark_n_routed_experts, *spec.shape), name
            assert leaf[t.expert].tobytes() == raw[name].tobytes(), name
        elif t.kind == "wo_a":
            scale_name = name.removesuffix(".weight") + ".scale"
            w = raw[name].view(ml_dtypes.float8_e4m3fn).reshape(spec.shape)
            want = np_dequant_fp8_weight(
                w, raw[scale_name].reshape(inv[scale_name].shape), cfg.weight_block_size
            )
            assert leaf.dtype == ml_dtypes.bfloat16
            assert leaf.tobytes() == want.astype(ml_dtypes.bfloat16).tobytes(), name
        else:
            assert leaf.shape == spec.shape and leaf.tobytes() == raw[name].tobytes(), name
    # The model's leaves are unaffected by the optional items.
    text = tmp_path / "text"
    convert(src, text, ConvertOptions(progress=False, include=("text",)))
    m_text = json.loads((text / MANIFEST_NAME).read_text())
    assert set(m_text["items"]) == {"params", "engram"}
    ignored = {i["name"]: i["reason"] for i in m_text["tensors"]["ignored"]}
    assert set(ignored) == {n for n, s in inv.items() if s.group in ("dspark", "vision")}
    assert all("--include dspark" in ignored[n] for n in ignored if n.startswith("mtp."))
    a, b = load_flat(out)[1], load_flat(text)[1]
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_include_dspark_bf16(multimodal, tmp_path):
    cfg, src = multimodal
    out = tmp_path / "bf16"
    convert(src, out, ConvertOptions(progress=False, include=("text", "dspark"), weights_dtype="bf16"))
    dspark = flatten(restore(out).parts["dspark"])
    assert not any(p.endswith(".scale") for p in dspark)
    w1 = dspark["mtp.1.ffn.experts.w1.weight"]
    assert w1.dtype == ml_dtypes.bfloat16
    assert w1.shape == (cfg.dspark_n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    raw = dict(iter_raw_tensors(src, ["mtp.1.ffn.experts.3.w1.weight", "mtp.1.ffn.experts.3.w1.scale"]))
    packed = raw["mtp.1.ffn.experts.3.w1.weight"].reshape(cfg.moe_intermediate_size, -1)
    scale = raw["mtp.1.ffn.experts.3.w1.scale"].reshape(cfg.moe_intermediate_size, -1).astype(np.float64)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(cfg.moe_intermediate_size, -1)
    want = FP4_TABLE[codes].astype(np.float64) * np.repeat(2.0 ** (scale - 127), 32, axis=-1)
    np.testing.assert_array_equal(w1[3].astype(np.float64), want)


# ---------------------------------------------------------------------- failures
def test_truncated_shard(ckpt, tmp_path, capsys):
    path = ckpt / SHARDS[1]
    path.write_bytes(path.read_bytes()[:-1000])
    assert_fails(ckpt, tmp_path / "out", capsys, SHARDS[1], "truncated")


def test_shard_missing_from_index(ckpt, tmp_path, capsys):
    edit_index(ckpt, lambda wm: [wm.pop(k) for k in [k for k, v in wm.items() if v == SHARDS[2]]])
    assert_fails(ckpt, tmp_path / "out", capsys, SHARDS[2], "shard missing from", "present on disk")


def test_shard_named_by_index_but_missing_on_disk(ckpt, tmp_path, capsys):
    (ckpt / SHARDS[2]).unlink()
    assert_fails(ckpt, tmp_path / "out", capsys, SHARDS[2], "missing")


def test_tensor_in_index_but_absent_from_shard(ckpt, tmp_path, capsys):
    rewrite_shard(ckpt / SHARDS[0], lambda a: a.pop("layers.0.attn.wq_b.scale"))
    assert_fails(ckpt, tmp_path / "out", capsys, "layers.0.attn.wq_b.scale", SHARDS[0], "absent")


def test_wrong_dtype(ckpt, tmp_path, capsys):
    def to_f32(a):
        a["layers.0.attn.q_norm.weight"] = a["layers.0.attn.q_norm.weight"].astype(np.float32)

    rewrite_shard(ckpt / SHARDS[0], to_f32)
    assert_fails(ckpt, tmp_path / "out", capsys, "layers.0.attn.q_norm.weight", "expected BF16, got F32")


def test_failure_midway_leaves_nothing(ckpt, tmp_path, monkeypatch, capsys):
    """A failure after several groups were already saved (here: the third shard turns out
    unreadable in the data pass) still leaves no output and no temporary directory."""
    from conversion.stream import StreamReader

    real = StreamReader.__init__

    def failing(self, path, progress):
        if path.name == SHARDS[2]:
            raise ConversionError(f"{path}: simulated read failure")
        real(self, path, progress)

    monkeypatch.setattr(StreamReader, "__init__", failing)
    assert_fails(ckpt, tmp_path / "out", capsys, SHARDS[2], "simulated")


# ---------------------------------------------------------------------- interrupted conversions
@pytest.fixture(scope="module")
def synthetic_tiny(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("synthetic") / "hf"
    write_synthetic_checkpoint(preset("tiny"), src, seed=5)
    return src


def _start_conversion(src: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    """`convert_weights` in a subprocess, returned once its temporary directory (with the owner
    marker) exists, i.e. mid-conversion."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ced_cli.main", "convert", "--hf-dir", str(src), "--out", str(out), "--quiet"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        temps = [p for p in out.parent.glob(f".{out.name}.converting-*") if (p / OWNER_MARKER).is_file()]
        if temps:
            return proc, temps[0]
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"no temporary directory appeared; exit {proc.wait()}: {proc.stderr.read()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_cleans_up_like_ctrl_c(synthetic_tiny, tmp_path, sig):
    out = tmp_path / "out"
    proc, temp = _start_conversion(synthetic_tiny, out)
    assert proc.poll() is None  # still converting
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted by {sig.name}" in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert not temp.exists() and not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_next_run_removes_what_a_killed_run_left(synthetic_tiny, tmp_path, capsys):
    """kill -9 leaves the temporary directory; the next conversion to the same --out removes it, and
    only it: a look-alike without an owner marker, one whose owner is alive, and one made on another
    host stay."""
    out = tmp_path / "out"
    proc, temp = _start_conversion(synthetic_tiny, out)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert temp.is_dir()  # what kill -9 leaves behind
    dead_pid = json.loads((temp / OWNER_MARKER).read_text())["pid"]

    unmarked = tmp_path / ".out.converting-unmarked"
    unmarked.mkdir()
    (unmarked / "data").write_text("someone else's")
    alive = tmp_path / ".out.converting-alive"
    alive.mkdir()
    (alive / OWNER_MARKER).write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": None})
    )
    remote = tmp_path / ".out.converting-remote"
    remote.mkdir()
    (remote / OWNER_MARKER).write_text(json.dumps({"pid": dead_pid, "host": "another-host", "start": None}))
    other = tmp_path / ".other.converting-1-2"  # a conversion to another --out
    other.mkdir()
    (other / OWNER_MARKER).write_text((temp / OWNER_MARKER).read_text())

    assert convert_main(["--hf-dir", str(synthetic_tiny), "--out", str(out), "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stale_temporaries_removed"] == [temp.name]
    assert not temp.exists() and (out / MANIFEST_NAME).is_file()
    assert unmarked.is_dir() and (unmarked / "data").is_file()
    assert alive.is_dir() and remote.is_dir() and other.is_dir()


def test_killed_while_replacing_restores_the_previous_conversion(synthetic_tiny, tmp_path, capsys):
    """A run killed between moving the old --out aside and moving the new one in: the next run puts
    the previous conversion back before it starts (and then replaces it as asked)."""
    from conversion.outdir import make_own_directory

    out = tmp_path / "out"
    assert convert_main(["--hf-dir", str(synthetic_tiny), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that is certainly gone
    aside = make_own_directory(tmp_path, ".out.replaced-")
    owner = json.loads((aside / OWNER_MARKER).read_text())
    (aside / OWNER_MARKER).write_text(json.dumps({**owner, "pid": proc.pid, "start": None}))
    os.rename(out, aside / "old")
    from conversion.outdir import remove_stale_temporaries

    assert remove_stale_temporaries(out) == [aside.name]
    assert (out / MANIFEST_NAME).is_file() and not aside.exists()


# ---------------------------------------------------------------------- config values the tensors contradict
@pytest.mark.parametrize(
    ("key", "value", "needles"),
    [
        (
            "hidden_size",
            128,
            ["text_config.hidden_size=128", "'embed.weight'", "hidden_size=256 would match"],
        ),
        ("hidden_size", 100, ["text_config.hidden_size=100", "multiple of 32", "layers.0.ffn.experts.0.w1"]),
        ("moe_intermediate_size", 256, ["text_config.moe_intermediate_size=256", "'layers.0.", "=128 would"]),
        ("o_lora_rank", 32, ["text_config.o_lora_rank=32", "'layers.0.attn.wo_a.", "o_lora_rank=64 would"]),
        ("n_routed_experts", 4, ["text_config.n_routed_experts=4", "'layers.0.ffn.experts.4."]),
        ("n_routed_experts", 16, ["text_config.n_routed_experts=16", "'layers.0.ffn.experts.8."]),
        ("engram_num_embeddings", [100, 13416], ["engram_num_embeddings[0]=100", "'layers.1.engram.embed."]),
    ],
)
def test_config_value_the_tensors_contradict(ckpt, tmp_path, capsys, key, value, needles):
    """One line naming the config key and the tensor, exit 2 (an AssertionError traceback for
    dimensions FP4 cannot pack; the tensor alone otherwise)."""
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"][key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    err = assert_fails(ckpt, tmp_path / "out", capsys, *needles)
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_attention_heads", 0), ("hc_mult", 0), ("rms_norm_eps", float("nan")), ("index_topk", -5)],
)
def test_out_of_range_config_values_exit_2_in_one_line(ckpt, tmp_path, capsys, key, value):
    """Issue 33.8: a traceback (0 heads, hc_mult 0) or a conversion that exits 0 (NaN epsilon,
    negative top-k) before; now one line naming the key, nothing written."""
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"][key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    err = assert_fails(ckpt, tmp_path / "out", capsys, key, "must be")
    assert err.count("\n") == 1 and "Traceback" not in err, err


# ---------------------------------------------------------------------- loading prints no warnings
def test_loading_a_conversion_warns_of_nothing(converted, caplog, capsys):
    """Orbax's 'This may be a sign of a malformed checkpoint' warning (it does not recognise zarr3
    data files) is not printed for a valid conversion, compressed (zarr3) or not (OCDBT)..."""
    import ced_jax

    out, _ = converted
    capsys.readouterr()
    with caplog.at_level(logging.INFO):
        restore(out)
        ced_jax.load(out)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not messages, messages
    captured = capsys.readouterr()
    assert "malformed" not in captured.err + captured.out


def test_loading_an_item_with_missing_data_fails(converted, tmp_path):
    """...and a conversion whose array data is really missing is refused, naming the leaf."""
    out, _ = converted
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "params" / "state" / "embed.weight" / "zarr.json").unlink()
    with pytest.raises(CheckpointError, match=r"leaf embed\.weight has no data"):
        restore(broken)


def test_default_include_converts_what_load_reads(multimodal, tmp_path):
    """Without --include, a checkpoint whose config describes DSpark stages and whose index lists
    them is converted with its dspark item (and vision item), so `ced_jax.load` of the conversion
    gives the HF directory's stages by default."""
    import ced_jax

    # The synthetic checkpoint with the tiny preset's Engram token map (same vocabulary), which
    # `ced_jax.load` needs for the Engram layers.
    src = tmp_path / "hf"
    src.mkdir()
    for f in multimodal[1].iterdir():
        (src / f.name).symlink_to(f)
    shutil.copyfile(
        REPO / "ced_jax" / "assets" / "tiny" / "engram_token_map.json", src / "engram_token_map.json"
    )
    out = tmp_path / "default"
    assert run_cli(src, out) == 0
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["options"]["include"] == ["text", "dspark", "vision"]
    assert set(m["items"]) == {"params", "engram", "dspark", "vision"} and m["tensors"]["ignored"] == []
    from_hf, from_converted = ced_jax.load(src), ced_jax.load(out)
    assert from_hf.has_draft_stages and from_converted.has_draft_stages
    a, b = flatten(from_converted.params["mtp"]), flatten(from_hf.params["mtp"])
    assert sorted(a) == sorted(b)
    for path, want in b.items():
        got, want = np.asarray(a[path]), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), path


def test_default_include_without_listed_stages(multimodal, tmp_path, capsys):
    """The default follows the index: stages the config describes but the index does not list (a
    checkpoint stripped of them) leave "dspark" out, as `ced_jax.load(with_draft=None)` does; a config
    without stages never gets it; an index listing only some stage tensors is refused by name."""
    from conversion.plan import default_include

    cfg, src = multimodal
    inv = hf_inventory(cfg)
    assert default_include(cfg, inv) == ("text", "dspark", "vision")
    assert default_include(cfg, [n for n, s in inv.items() if s.group != "dspark"]) == ("text", "vision")
    no_stages = cfg.replace(num_nextn_predict_layers=0, vision=None)
    assert default_include(no_stages, hf_inventory(no_stages)) == ("text",)
    # Partial: one stage tensor dropped from the index. Its shard would then hold a tensor the index
    # does not assign, but the default's own check comes first and says what to do.
    dropped = "mtp.1.ffn.experts.3.w1.weight"
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in src.iterdir():
        (partial / f.name).symlink_to(f)
    (partial / INDEX).unlink()
    shutil.copyfile(src / INDEX, partial / INDEX)
    edit_index(partial, lambda wm: wm.pop(dropped))
    assert_fails(partial, tmp_path / "out", capsys, INDEX, dropped, "--include text")


def test_ctrl_c_storm_during_overwrite_keeps_the_previous_conversion(synthetic_tiny, tmp_path, capsys):
    """Issue 33.3's reproduction, several times: a conversion, then the same again with --overwrite,
    SIGINT 0.6 s after its temporary directory appears and 5 more 0.4 s apart. Every run exits 130
    with one line, leaves the previous output byte for byte and no temporary directory (the handler
    only records the signal; it was swallowed when it landed in a garbage-collection callback)."""
    out = tmp_path / "out"
    assert convert_main(["--hf-dir", str(synthetic_tiny), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ced_cli.main", "convert", "--hf-dir", str(synthetic_tiny),
             "--out", str(out), "--quiet", "--overwrite"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".out.converting-*")) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.6)
        assert proc.poll() is None  # still converting when interrupted
        for _ in range(6):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.4)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert "interrupted by SIGINT" in err.strip().splitlines()[-1] and "Traceback" not in err, err
        assert "ignored" not in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        assert after == before


@pytest.mark.slow
def test_a_failed_write_is_one_line_and_leaves_nothing(synthetic_tiny, tmp_path):
    """Issue 33.8: on a full disk the conversion printed 26 Orbax and TensorStore tracebacks before its
    one-line error (asyncio's "Event loop is closed" from TensorStore's threads, "exception was
    never retrieved" at exit), and 2 of 6 runs left the temporary directory behind. A file-size
    limit (RLIMIT_FSIZE, SIGXFSZ ignored) fails the save's writes the same way, here without a small
    filesystem; measured before the fix: 133-151 lines of stderr per run. Six runs."""
    import resource

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))

    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "ced_cli.main",
        "convert",
        "--hf-dir",
        str(synthetic_tiny),
        "--out",
        str(out),
    ]
    for quiet in (True, False) * 3:
        proc = subprocess.run(
            argv + ["--quiet"] * quiet, cwd=REPO, preexec_fn=small_files, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
        errors = [line for line in lines if not line.startswith("convert:")]  # the progress bar
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert errors[0].startswith("ced-jax convert: error:") and "Error writing" in errors[0], errors
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_orbax_worker_errors_are_left_to_the_one_line_error():
    """Issue 33.8 (part): on a full disk each Orbax worker thread logged the save's failure with a
    traceback before the conversion reported it in one line; those records are filtered (others pass)."""
    from conversion.save_noise import QuietNonOcdbtMerge

    quiet = QuietNonOcdbtMerge()

    def record(level, message):
        return logging.LogRecord("absl", level, __file__, 1, message, None, None)

    failure = (
        "[thread=v1_leaf_handler] _SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED: No space"
    )
    assert not quiet.filter(record(logging.ERROR, failure))
    assert not quiet.filter(record(logging.WARNING, "Skipping merge of OCDBT checkpoints: none"))
    assert quiet.filter(record(logging.ERROR, "something else went wrong"))
    assert quiet.filter(record(logging.INFO, failure))
