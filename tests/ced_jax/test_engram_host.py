"""Engram off device (issue 12, point 1): the tables stay on the host, each step's rows are gathered
there (`ced_jax.engram_store`) and shipped with the step's inputs; logits are bit-identical to the
on-device gather, and no parameter placed on device holds a table."""

from __future__ import annotations

import json
import mmap
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.api import Model, load
from ced_jax.config import ModelConfig, preset
from ced_jax.engine import Engine, StateShapes
from ced_jax.engram_hash import EngramHasher
from ced_jax.engram_store import (
    RAW_DIR,
    EngramStore,
    EngramStoreError,
    engram_config_hash,
    table_leaves,
    table_specs,
    write_raw,
)
from ced_jax.model.layers.engram import engram
from ced_jax.testing.random_weights import random_params, tiny_params
from tests.conftest import GOLDEN_TINY_A, REPO

MID = REPO / "bench" / "configs" / "mid"


def _leaf_paths(tree) -> list[str]:
    return [
        jax.tree_util.keystr(p, simple=True, separator=".")
        for p, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _mapped(a) -> bool:
    """Whether array `a` is a view of a memory-mapped file."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap)


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny"), tiny_params(with_draft=False)


def test_layer_on_gathered_rows_is_bit_identical(tiny):
    """One Engram layer: ids into the on-device table vs the same rows gathered on the host."""
    cfg, flat = tiny
    i = cfg.engram_layer_ids[0]
    prefix = f"layers.{i}.engram."
    p = {}
    for name, arr in flat.items():
        if name.startswith(prefix):
            node = p
            *parents, leaf = name[len(prefix) :].split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = jnp.asarray(arr)
    rng = np.random.default_rng(0)
    b, t, c = 2, 3, cfg.engram_hash_cols
    ids = rng.integers(0, cfg.engram_num_embeddings[0], (b, t, 1, c)).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((b, t, cfg.hc_mult, cfg.hidden_size)).astype(np.float32))
    store = EngramStore.from_flat(cfg, flat)
    gathered = store.gather(np.concatenate([ids, np.zeros_like(ids)], axis=2))
    own = {"weight": gathered["weight"][:, :, 0], "scale": gathered["scale"][:, :, 0]}
    without = {k: v for k, v in p.items() if k != "embed"}
    run = jax.jit(lambda x, rows, p: engram(x, rows, p, eps=cfg.rms_norm_eps))
    on_device = np.asarray(run(x, ids[:, :, 0], p))
    on_host = np.asarray(run(x, own, without))
    assert np.array_equal(on_device, on_host)
    assert not np.array_equal(on_device, np.asarray(x))  # the layer did something
    with pytest.raises(ValueError, match="gathered rows given"):
        engram(x, own, p, eps=cfg.rms_norm_eps)
    with pytest.raises(ValueError, match="row ids given"):
        engram(x, ids[:, :, 0], without, eps=cfg.rms_norm_eps)


def test_gather_is_the_table_rows(tiny):
    cfg, flat = tiny
    store = EngramStore.from_flat(cfg, flat)
    rng = np.random.default_rng(1)
    ids = np.stack(
        [rng.integers(0, n, (3, 2, cfg.engram_hash_cols)) for n in cfg.engram_num_embeddings], axis=2
    ).astype(np.int32)
    out = store.gather(ids)
    for k, (w, s) in enumerate(table_leaves(cfg)):
        assert (
            out["weight"][:, :, k].view(np.uint8).tobytes() == flat[w][ids[:, :, k]].view(np.uint8).tobytes()
        )
        assert np.array_equal(out["scale"][:, :, k], flat[s][ids[:, :, k]])
    assert store.bytes_per_token == len(cfg.engram_layer_ids) * cfg.engram_hash_cols * (
        cfg.engram_head_dim + cfg.engram_head_dim // 32
    )
    bad = ids.copy()
    bad[0, 0, 1, 0] = cfg.engram_num_embeddings[1]
    with pytest.raises(EngramStoreError, match="layer 1 rows"):
        store.gather(bad)


def test_raw_files_round_trip_and_refuse_another_config(tiny, tmp_path):
    cfg, flat = tiny
    for leaf in table_specs(cfg):
        write_raw(tmp_path, cfg, leaf, flat[leaf])
    store = EngramStore.open_raw(tmp_path, cfg)
    assert store.files == [tmp_path / f"{leaf}.bin" for pair in table_leaves(cfg) for leaf in pair]
    for (w, s), (mw, ms) in zip(table_leaves(cfg), store.tables, strict=True):
        assert _mapped(mw) and _mapped(ms) and not mw.flags.writeable
        assert mw.tobytes() == flat[w].tobytes() and ms.tobytes() == flat[s].tobytes()
        assert (tmp_path / f"{w}.bin").stat().st_size == flat[w].nbytes  # raw bytes, no header inside
    # a gather from the mapped files (threaded pieces) gives the in-memory store's bytes
    rng = np.random.default_rng(2)
    ids = np.stack(
        [rng.integers(0, n, (5, 7, cfg.engram_hash_cols)) for n in cfg.engram_num_embeddings], axis=2
    ).astype(np.int32)
    mapped, in_memory = store.gather(ids), EngramStore.from_flat(cfg, flat).gather(ids)
    for part in ("weight", "scale"):
        assert mapped[part].shape == in_memory[part].shape
        assert mapped[part].tobytes() == in_memory[part].tobytes()
    leaf = table_leaves(cfg)[0][0]
    header = json.loads((tmp_path / f"{leaf}.json").read_text())
    assert header["shape"] == list(flat[leaf].shape) and header["dtype"] == "float8_e4m3fn"
    assert header["config_hash"] == engram_config_hash(cfg)
    # Same table shapes, another hashing config: the rows would mean something else.
    other = cfg.replace(engram_pad_token_id=cfg.engram_pad_token_id + 1)
    assert table_specs(other) == table_specs(cfg)
    with pytest.raises(EngramStoreError, match=r"config_hash .*written for another Engram config"):
        EngramStore.open_raw(tmp_path, other)
    bigger = cfg.replace(engram_num_embeddings=tuple(n + 1 for n in cfg.engram_num_embeddings))
    with pytest.raises(EngramStoreError, match="config_hash|shape"):
        EngramStore.open_raw(tmp_path, bigger)
    with open(tmp_path / f"{leaf}.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(EngramStoreError, match="10 bytes, the header says"):
        EngramStore.open_raw(tmp_path, cfg)
    with pytest.raises(EngramStoreError, match="the config needs"):
        write_raw(tmp_path, cfg, leaf, flat[leaf][:-1])


def test_no_table_leaf_on_device():
    """Placement host: the parameter tree (what goes to the device) and an engine's state carry no
    Engram table; the store holds exactly the tables the device placement puts in the params."""
    host = load(str(GOLDEN_TINY_A), engram_placement="host")
    device = load(str(GOLDEN_TINY_A), engram_placement="device")
    cfg = host.cfg
    tables = set(table_specs(cfg))
    assert tables <= set(_leaf_paths(device.params))
    assert set(_leaf_paths(host.params)) == set(_leaf_paths(device.params)) - tables
    on_device = sum(a.nbytes for a in jax.tree.leaves(host.params))
    assert on_device == sum(a.nbytes for a in jax.tree.leaves(device.params)) - host.engram_store.nbytes
    assert device.engram_store is None and host.engram_placement == "host"
    engine = Engine(host, StateShapes(max_slots=1, page_size=16, num_pages=4, max_context=64))
    sizes = {tuple(a.shape) for a in jax.tree.leaves(engine.state)}
    assert not any(tuple(shape) in sizes for shape, _ in table_specs(cfg).values())
    for (w, s), (hw, hs) in zip(table_leaves(cfg), host.engram_store.tables, strict=True):
        assert np.asarray(_get(device.params, w)).tobytes() == hw.tobytes()
        assert np.asarray(_get(device.params, s)).tobytes() == hs.tobytes()
    with pytest.raises(ValueError, match="engram_placement"):
        load(str(GOLDEN_TINY_A), engram_placement="gpu")


def _get(tree, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def test_converted_checkpoint_memory_maps_its_raw_tables(tmp_path):
    """convert_weights writes the raw tables beside the Orbax Engram item; a host load maps them."""
    from conversion.convert import ConvertOptions, convert

    out = tmp_path / "conv"
    convert(GOLDEN_TINY_A, out, ConvertOptions(progress=False))
    manifest = json.loads((out / "ced_manifest.json").read_text())
    cfg = ModelConfig.from_pretrained(out)
    assert sorted(manifest["engram_raw"]["leaves"]) == sorted(table_specs(cfg))
    model = load(str(out), engram_placement="host")
    reference = load(str(GOLDEN_TINY_A), engram_placement="host")
    assert model.engram_store.files and all(f.parent == out / RAW_DIR for f in model.engram_store.files)
    for (mw, ms), (rw, rs) in zip(model.engram_store.tables, reference.engram_store.tables, strict=True):
        assert _mapped(mw) and _mapped(ms)
        assert mw.tobytes() == rw.tobytes() and ms.tobytes() == rs.tobytes()
    shutil.rmtree(out / RAW_DIR)  # as --no-engram-raw writes it
    fallback = load(str(out), engram_placement="host")  # the Orbax Engram item, read into host memory
    assert not fallback.engram_store.files
    for (fw, fs), (rw, rs) in zip(fallback.engram_store.tables, reference.engram_store.tables, strict=True):
        assert fw.tobytes() == rw.tobytes() and fs.tobytes() == rs.tobytes()


def _logits_both(cfg, flat, hasher, prompt, decode):
    out = {}
    for placement in ("device", "host"):
        model = Model(
            cfg, dict(flat), hasher=hasher, tokenizer_path=None, engram_placement=placement, prefill_chunk=16
        )
        out[placement] = model.logits(prompt, decode)
    return out


@pytest.mark.slow  # two compiles of the tiny-a prefill and decode programs (minutes on 2 cores)
def test_tiny_a_logits_bit_identical():
    out = {p: load(str(GOLDEN_TINY_A), engram_placement=p, prefill_chunk=16) for p in ("device", "host")}
    inputs = json.loads((GOLDEN_TINY_A / "inputs.json").read_text())
    res = {p: m.logits(inputs["prompt_ids"][:20], inputs["decode_ids"][:3]) for p, m in out.items()}
    for key in ("prefill_logits_full", "decode_logits"):
        assert np.array_equal(np.asarray(res["host"][key]), np.asarray(res["device"][key])), key


@pytest.mark.slow  # random weights at mid shapes (0.9 GB) and the mid step program compiled twice
def test_mid_logits_bit_identical():
    """Prefill only (one program per placement): every position's Engram rows feed its logits; the
    one-token decode shape is covered on tiny-a."""
    cfg = ModelConfig.from_pretrained(MID)
    flat = random_params(cfg, 7)
    hasher = EngramHasher.from_token_map_file(cfg, MID / "engram_token_map.json")
    res = _logits_both(cfg, flat, hasher, [5, 900, 17, 33, 2048, 7, 11, 4000], [])
    host, device = (
        np.asarray(res["host"]["prefill_logits_full"]),
        np.asarray(res["device"]["prefill_logits_full"]),
    )
    assert host.shape == (8, cfg.vocab_size) and np.isfinite(host).all()
    assert np.array_equal(host, device)
