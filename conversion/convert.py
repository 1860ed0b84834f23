"""`convert_weights`: a released-layout DeepSeek-V4.1 HF checkpoint -> an Orbax checkpoint, streaming.

    convert_weights --hf-dir DIR --out DIR [--include text,dspark,vision] [--engram separate|inline|skip]
                    [--weights-dtype native|bf16] [--overwrite]

Output layout (OUT/)
- `params/`: an Orbax v1 checkpoint of our parameter tree (`ced_jax.model.param_specs`), nested dicts
  keyed by the dotted path ('layers' -> '3' -> 'attn' -> 'wq_a' -> 'weight'), numpy leaves, so it
  restores onto any mesh (`restore`) or into host memory.
- `engram/` (with `--engram separate`, the default): the Engram hash tables
  (`layers.{i}.engram.embed.{weight,scale}`, same nesting) as their own Orbax checkpoint, so that a
  server can keep them in host memory (they are looked up by row, ~98 GB each in the release)
  while `params/` goes to the accelerators. `--engram inline` puts them in `params/`; `--engram
  skip` leaves them out (such a checkpoint cannot run the model; it is for inspecting the rest).
- `engram_raw/` (with `--engram separate` and native weights; `--no-engram-raw` leaves it out): the
  same tables once more as raw row-major files, `{leaf}.bin` (the array's bytes, nothing else) and
  `{leaf}.json` (shape, dtype, bytes, a hash of the config's Engram fields), which
  `ced_jax.engram_store.EngramStore.open_raw` memory-maps: with the Engram placement `host` (the
  default) `ced_jax.load` gathers each step's rows from them and never reads the Orbax item, so the
  tables cost neither device memory nor their size in host RAM. Twice the tables' disk space.
- `dspark/`, `vision/`: the DSpark draft stages (`mtp.*`, with `--include dspark`) and the vision
  tower, aligner and image delimiters (`ced_jax.checkpoint.vision.load_vision_params` reads them back), each
  as its own Orbax item restored into host memory. Without an explicit `--include` (options
  `include=None`), the vision item is written whenever config.json describes a vision tower, and the
  DSpark item whenever config.json describes DSpark stages (num_nextn_predict_layers > 0) and the
  index lists their `mtp.*` tensors, so a default conversion serves images and speculative decoding
  and `ced_jax.load(OUT)` gives what `ced_jax.load(HF_DIR)` gives (a checkpoint whose index lists
  none of the stages, e.g. one stripped of them, converts as text; one listing only some of them is
  an error naming a missing tensor). An explicit `--include text` leaves both out. DSpark stages
  are laid out like backbone layers (routed experts stacked, `mtp.{k}.attn.wo_a` dequantised);
  vision tensors keep their released names. Shapes and dtypes come from the config's inventory like
  everything else. Parts not included are ignored and listed in the manifest.
- `config.json`, `tokenizer.json`, `tokenizer_config.json`, `engram_token_map.json`: copied byte for
  byte when present, so `ced-jax describe OUT` reports what it reports on the source.
- `ced_manifest.json`: converter version, options, every source file (name, bytes, SHA-256), every
  leaf (item, shape, dtype), every ignored source tensor with the reason.

Formats (`--weights-dtype`)
- native (default): the stored bytes unchanged in our storage dtypes (`mapping.STORAGE_DTYPES`):
  FP8 e4m3 weights with their ue8m0 scale bytes, FP4 experts packed two per byte and stacked
  [E, ...], bf16 / f32 as stored. `attn.wo_a` is dequantised to bf16 as DeepSeek's converter does
  (its scale is consumed). This is what `ced_jax` runs.
- bf16: every quantised weight dequantised (exactly: e4m3 / e2m1 values times a power of two fit in
  bf16) into a bf16 leaf with no `.scale`, for backends without FP8/FP4 kernels. `ced_jax`'s model
  itself runs the native formats and refuses such a checkpoint.
- `--include` must contain `text`; `dspark` / `vision` are errors when config.json describes no
  such part.

Streaming and memory
- Everything is validated before any tensor data is read: the index against the inventory of the
  config (`mapping.hf_inventory`), every shard's header against the index and the inventory, stray
  shards the index does not mention. Every failure is a `ConversionError` naming the tensor / file.
- Data: shard by shard, each read front to back with plain `read` calls (not mmap, so the page
  cache does not count towards our RSS; safetensors' numpy reader cannot produce F8 anyway), each
  byte hashed once for the manifest. Tensors are read straight into their destination (an expert
  into its slot of the stacked array). A tensor group (one layer, one Engram table, the embedding,
  the final norm + head) is saved with `ocp.v1.partial.save` as soon as its last tensor has been
  read, then freed (gc + malloc_trim), so the peak is about the largest group (in output bytes) plus
  the interpreter, JAX and Orbax. An Engram table is one group: with `--engram skip` or a smaller
  table the bound is a layer. Compressed items are plain zarr3 (a directory per leaf, a file per
  chunk), because OCDBT holds every encoded chunk of a save until it commits (+0.7x a group);
  uncompressed items are OCDBT, whose chunks only reference the group's arrays. `bench/convert.py`
  measures the bound on a 4.3 GiB checkpoint (BENCHMARKS.md, "Conversion").
- Atomicity: everything is written into a temporary directory beside OUT
  (`.OUT.converting-<pid>-<random>`, mode 0777 minus the umask like any new directory) and renamed
  onto OUT at the end; on any failure, Ctrl-C or SIGTERM the temporary directory is removed, OUT is
  untouched and the exit status is non-zero (130 / 143 for the signals). A temporary directory holds
  an owner marker (`OWNER_MARKER`: pid, host, process start time) written right after it is made; a
  run that was killed outright (kill -9, power loss) leaves its directory behind, and the next
  conversion to the same OUT removes it once the marker's process is gone. Nothing without such a
  marker, nor one whose owner is alive or on another host, is ever removed.
- What is never destroyed: `--out` may not be empty, nor inside / a parent of `--hf-dir`. Without
  `--overwrite` an existing OUT is refused; with it, OUT is replaced only when it is a previous
  conversion (`ced_manifest.json` of this format inside) or an empty directory, and never when it
  is `/`, the home directory, the working directory or one of their parents. All of this is
  checked before any tensor is read, and again just before the old OUT is moved aside.
- Orbax chunks: one per routed expert in the stacked arrays (a restore with experts sharded over
  devices reads only its own experts), otherwise at most `CHUNK_BYTES`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import glob
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ced_jax.checkpoint.converted import (
    ENGRAM_ITEM,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    OPTIONAL_PARTS,
    EngramMode,
    WeightsDtype,
    item_of,
    target_specs,
)
from ced_jax.checkpoint.digest import file_sha256
from ced_jax.checkpoint.hf_loader import (
    INDEX_NAME,
    CheckpointError,
    LoadReport,
    Shard,
    check_shard_header,
    classify_tensors,
    read_index_json,
)
from ced_jax.checkpoint.mapping import (
    FP4_GROUP,
    STORAGE_DTYPES,
    TEXT_GROUPS,
    TensorSpec,
    hf_inventory,
    optional_group_of,
    our_param_specs,
    our_target,
)
from ced_jax.config import ConfigError, ModelConfig
from ced_jax.engram_store import RAW_DIR, write_raw
from ced_jax.model import ParamSpec
from ced_jax.trees import nest
from conversion.save_noise import QuietNonOcdbtMerge, closed_loop_tracebacks_dropped
from pallas_kernels.formats import np_dequant_fp4_weight, np_dequant_fp8_weight

CONVERTER_VERSION = "1.0"
# Copied beside the checkpoint when the source has them (config.json is required).
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "engram_token_map.json")
# Inside every temporary directory a conversion makes: who made it (see `_owner_is_gone`).
OWNER_MARKER = ".ced_convert_owner.json"
CHUNK_BYTES = 64 << 20  # Orbax chunk size: restore granularity along axis 0
READ_PIECE = 64 << 20  # bytes per read call: progress granularity and hashing in step with reads

INCLUDE_CHOICES = ("text", "dspark", "vision")
_PART_LABEL = {
    "dspark": "DSpark draft stage tensor (mtp.*)",
    "vision": "vision tower / aligner / image delimiter tensor",
}


class ConversionError(CheckpointError):
    """A conversion that cannot be done as asked; the message names the file / tensor / option."""


@dataclass(frozen=True)
class ConvertOptions:
    # None: "text", plus "vision" when config.json describes a vision tower and "dspark" when it
    # describes DSpark stages whose tensors the index lists (`default_include`, module docstring).
    include: tuple[str, ...] | None = None
    engram: EngramMode = "separate"
    weights_dtype: WeightsDtype = "native"
    overwrite: bool = False
    progress: bool = True
    compression: bool = True  # Orbax's zstd; off trades disk for speed on incompressible weights
    # With engram "separate" and native weights: also the raw memory-mappable tables (`RAW_DIR`).
    engram_raw: bool = True


# ---------------------------------------------------------------------- plan (validation pass)
@dataclass
class _Group:
    key: str
    item: str
    names: list[str] = field(default_factory=list)  # HF tensors consumed
    targets: set[str] = field(default_factory=set)  # leaves produced
    out_bytes: int = 0


@dataclass
class _Plan:
    cfg: ModelConfig
    inventory: dict[str, TensorSpec]
    weight_map: dict[str, str]
    files: list[str]
    file_sizes: dict[str, int]
    targets: dict[str, ParamSpec]
    groups: dict[str, _Group]
    group_of: dict[str, str]  # consumed HF name -> group key
    ignored: dict[str, str]  # HF name -> why
    folded: list[str]  # scales consumed by a dequantisation (no leaf of their own)


def _group_key(name: str, spec: TensorSpec) -> str:
    if spec.group == "engram_table":
        return name.rsplit(".", 1)[0]  # layers.{i}.engram.embed: the table is a group of its own
    parts = name.split(".")
    if parts[0] in ("layers", "mtp"):
        return f"{parts[0]}.{parts[1]}"
    if parts[0] == "vision" and parts[1] == "blocks":
        return f"vision.blocks.{parts[2]}"
    if spec.group == "vision":
        return "vision"
    return "embed" if parts[0] == "embed" else "final"


def _target_path(name: str, spec: TensorSpec, weights_dtype: WeightsDtype) -> str | None:
    """The leaf an HF tensor ends up in, or None for a scale folded into its weight's leaf."""
    t = our_target(name)
    if t.kind == "wo_a_scale" or (weights_dtype == "bf16" and spec.is_scale):
        return None
    return t.path


def _check_include(include: Iterable[str]) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(i.strip() for i in include if i.strip()))
    for item in items:
        if item not in INCLUDE_CHOICES:
            raise ConversionError(f"--include: unknown part {item!r}; known: {list(INCLUDE_CHOICES)}")
    if "text" not in items:
        raise ConversionError("--include must contain 'text'")
    return items


def default_include(
    cfg: ModelConfig, indexed: Iterable[str], index_path: Path | str = INDEX_NAME
) -> tuple[str, ...]:
    """The parts a conversion without an explicit include writes: the text model; the vision tower
    when the config has one (small beside the text model, needed to serve images); the DSpark stages
    when the config describes them and the index (`indexed`: its tensor names) lists their tensors,
    which is when `ced_jax.load(dspark=None)` reads them from the HF directory, so the conversion
    loads the same by default. An index listing only some of them is a broken draft, not an absent
    one: a ConversionError naming a missing tensor (as `load` raises), not a silent text-only output."""
    parts = ["text"]
    if cfg.num_nextn_predict_layers > 0:
        indexed = set(indexed)
        stage_tensors = sorted(n for n, s in hf_inventory(cfg).items() if s.group == "dspark")
        missing = [n for n in stage_tensors if n not in indexed]
        if len(missing) < len(stage_tensors):
            if missing:
                raise ConversionError(
                    f"{index_path}: lists {len(stage_tensors) - len(missing)} of the {len(stage_tensors)} "
                    f"tensors of the {cfg.num_nextn_predict_layers} DSpark stages config.json describes; "
                    f"missing e.g. '{missing[0]}' (--include text converts without the draft stages)"
                )
            parts.append("dspark")
    if cfg.vision is not None:
        parts.append("vision")
    return tuple(parts)


def _check_parts_described(cfg: ModelConfig, include: tuple[str, ...], config_path: Path) -> None:
    if "dspark" in include and cfg.num_nextn_predict_layers == 0:
        raise ConversionError(
            f"--include dspark: {config_path} describes no DSpark stages (num_nextn_predict_layers is 0)"
        )
    if "vision" in include and cfg.vision is None:
        raise ConversionError(f"--include vision: {config_path} has no vision_config")


_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


def _check_shard_set(hf_dir: Path, files: list[str]) -> None:
    """Shards follow `<stem>-<i>-of-<n>.safetensors`: every i in 1..n must be named by the index, and
    no such file on disk may be left out of it (its tensors would be neither converted nor listed).
    Other .safetensors files (e.g. a fixture's expected outputs) are not shards and are left alone."""
    series: dict[tuple[str, int], set[int]] = {}
    for file in files:
        m = _SHARD_NAME.match(file)
        if m:
            series.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    on_disk = {p.name for p in hf_dir.glob("*.safetensors") if _SHARD_NAME.match(p.name)}
    unindexed = sorted(on_disk - set(files))
    for (stem, n), seen in sorted(series.items()):
        width = len(next(f for f in files if f.startswith(f"{stem}-")).rsplit("-of-", 1)[1]) - len(
            ".safetensors"
        )
        for i in range(1, n + 1):
            name = f"{stem}-{i:0{width}d}-of-{n:0{width}d}.safetensors"
            if i not in seen and name not in unindexed:
                unindexed.append(name)
    if unindexed:
        first = unindexed[0]
        state = "present on disk" if (hf_dir / first).exists() else "also absent from the directory"
        raise ConversionError(
            f"{hf_dir / first}: shard missing from {INDEX_NAME} ({state}); none of its tensors would be "
            f"converted or listed. Shards the index does not name: {unindexed[:5]}"
        )


def _raw_config(hf_dir: Path) -> dict:
    """config.json as written (ModelConfig has already accepted it)."""
    return json.loads((hf_dir / "config.json").read_text())


def _plan(hf_dir: Path, cfg: ModelConfig, options: ConvertOptions, include: tuple[str, ...]) -> _Plan:
    inventory = hf_inventory(cfg)
    weight_map = read_index_json(hf_dir)["weight_map"]
    text_groups = tuple(g for g in TEXT_GROUPS if not (g == "engram_table" and options.engram == "skip"))
    groups_wanted = text_groups + tuple(p for p in include if p in OPTIONAL_PARTS)
    files = sorted(set(weight_map.values()))
    _check_shard_set(hf_dir, files)  # first: a shard left out of the index explains missing tensors
    report = LoadReport(str(hf_dir))
    try:
        by_shard = classify_tensors(weight_map, inventory, groups_wanted, report)  # unknown / missing tensors
    except CheckpointError as e:
        unknown = sorted(n for n in weight_map if n not in inventory and optional_group_of(n) is None)
        missing = [
            s.name for s in inventory.values() if s.group in groups_wanted and s.name not in weight_map
        ]
        name = (unknown or missing or [None])[0]
        hint = name and _explain_names(_raw_config(hf_dir), name, present=bool(unknown))
        if hint:
            raise ConversionError(f"{e}; tensor '{name}': {hint}") from None
        raise
    ignored: dict[str, str] = {}
    for name, why in report.skipped:
        spec = inventory.get(name)
        if spec is None:  # an optional part config.json does not describe
            part = optional_group_of(name)
            why = f"{_PART_LABEL[part]} not described by config.json"
        elif spec.group == "engram_table":
            why = "Engram table left out (--engram skip)"
        elif spec.group in OPTIONAL_PARTS:
            why = f"{_PART_LABEL[spec.group]}, not included (--include {spec.group} converts it)"
        ignored[name] = why

    # Headers only, so that a bad file is reported before any data is read.
    file_sizes: dict[str, int] = {}
    indexed: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        indexed.setdefault(file, set()).add(name)
    for file in files:
        with Shard(hf_dir, file) as shard:
            present = set(shard.keys())
            # A shape that disagrees with the config: name the config key behind it.
            for name in by_shard.get(file, []):
                got = shard.dtype_shape(name)[1] if name in present else None
                if got is not None and got != inventory[name].shape:
                    expected = inventory[name].shape
                    hint = _explain_shape(_raw_config(hf_dir), name, expected, got)
                    raise ConversionError(
                        f"{shard.path}: tensor '{name}' is {list(got)}, config.json implies {list(expected)}"
                        + (f"; {hint}" if hint else "")
                    )
            # Tensors of this config are checked against the inventory; every indexed one (optional
            # groups the config does not describe included) must be present.
            check_shard_header(shard, by_shard.get(file, []), inventory)
            absent = sorted(indexed[file] - present)
            if absent:
                raise ConversionError(
                    f"{shard.path}: tensor '{absent[0]}' is in {INDEX_NAME} for this file but absent from it"
                )
            extra = sorted(present - indexed[file])
            if extra:
                where = [weight_map.get(n) for n in extra[:5]]
                raise ConversionError(
                    f"{shard.path}: {len(extra)} tensor(s) in the file that {INDEX_NAME} does not assign to "
                    f"it: {extra[:5]} (index says: {where})"
                )
        file_sizes[file] = (hf_dir / file).stat().st_size

    targets = target_specs(cfg, weights_dtype=options.weights_dtype, engram=options.engram, include=include)
    if options.weights_dtype == "native":
        # The model's tree and the HF table are written independently; they must agree leaf for leaf.
        mapped = our_param_specs(cfg, text_groups)
        ours = {
            p: (s.shape, np.dtype(s.dtype))
            for p, s in targets.items()
            if item_of(p, options.engram) not in OPTIONAL_PARTS
        }
        diff = sorted(p for p in set(mapped) | set(ours) if mapped.get(p) != ours.get(p))
        if diff:
            p = diff[0]
            raise ConversionError(
                "internal: ced_jax.model.param_specs and ced_jax.checkpoint.mapping disagree on "
                f"{len(diff)} leaves, "
                f"e.g. {p}: model {ours.get(p)}, mapping {mapped.get(p)}"
            )
    groups: dict[str, _Group] = {}
    group_of: dict[str, str] = {}
    folded: list[str] = []
    for name in weight_map:
        if name in ignored:
            continue
        spec = inventory[name]
        key = _group_key(name, spec)
        path = _target_path(name, spec, options.weights_dtype)
        item = item_of(path or our_target(spec.weight_name).path, options.engram)
        group = groups.setdefault(key, _Group(key, item))
        group.names.append(name)
        group_of[name] = key
        if path is None:
            folded.append(name)
            continue
        if path not in targets:
            raise ConversionError(
                f"tensor '{name}' (in {weight_map[name]}) maps to {path}, not a leaf of the model"
            )
        if path not in group.targets:
            group.targets.add(path)
            spec_t = targets[path]
            group.out_bytes += int(np.prod(spec_t.shape)) * np.dtype(spec_t.dtype).itemsize
    produced = {p for g in groups.values() for p in g.targets}
    missing = sorted(set(targets) - produced)
    if missing:
        raise ConversionError(f"{len(missing)} leaves of the model would not be produced, e.g. {missing[:5]}")
    return _Plan(
        cfg, inventory, weight_map, files, file_sizes, targets, groups, group_of, ignored, sorted(folded)
    )


# ---------------------------------------------------------------------- config keys behind a mismatch
def _check_fp4_dims(cfg: ModelConfig, config_path: Path) -> None:
    """Routed experts pack FP4 in groups of FP4_GROUP along their input dimension: w1/w3 along
    hidden_size, w2 along moe_intermediate_size. Anything else cannot describe a released checkpoint."""
    for key, value, tensor in (
        ("hidden_size", cfg.hidden_size, "layers.0.ffn.experts.0.w1.weight"),
        ("moe_intermediate_size", cfg.moe_intermediate_size, "layers.0.ffn.experts.0.w2.weight"),
    ):
        if value % FP4_GROUP:
            raise ConversionError(
                f"{config_path}: text_config.{key}={value} is not a multiple of {FP4_GROUP}, the FP4 "
                f"group of the routed experts along it (e.g. tensor '{tensor}')"
            )


# config.json entries that may decide a tensor's shape or existence, as paths into the JSON:
# (section, key) for an integer, (section, key, i) for an element of a list of integers.
# weight_block_size is a [B, B] pair and varied as one.
_BLOCK_KEY = ("quantization_config", "weight_block_size")
_KeyPath = tuple  # (str, str) or (str, str, int)


def _integer_keys(raw: dict, *, elements: bool) -> list[_KeyPath]:
    """The integer entries of config.json (`elements`: the elements of its integer lists instead)."""
    keys: list[_KeyPath] = []
    if not elements and isinstance(raw.get(_BLOCK_KEY[0]), dict):
        keys.append(_BLOCK_KEY)
    for section in ("text_config", "vision_config"):
        values = raw.get(section)
        for k, v in values.items() if isinstance(values, dict) else ():
            if not elements and isinstance(v, int) and not isinstance(v, bool):
                keys.append((section, k))
            if elements and isinstance(v, list) and all(isinstance(x, int) for x in v):
                keys += [(section, k, i) for i in range(len(v))]
    return keys


def _key_value(raw: dict, key: _KeyPath) -> int:
    value = raw[key[0]][key[1]]
    return value[key[2]] if len(key) == 3 else value[0] if key == _BLOCK_KEY else value


def _format_key(key: _KeyPath, value: int) -> str:
    index = f"[{key[2]}]" if len(key) == 3 else ""
    return f"{key[0]}.{key[1]}{index}={value}"


def _inventory_with(raw: dict, key: _KeyPath, value: int) -> dict[str, TensorSpec] | None:
    """The inventory config.json would give with `key` set to `value`; None when that config is not
    one the model accepts."""
    trial = copy.deepcopy(raw)
    if len(key) == 3:
        trial[key[0]][key[1]][key[2]] = value
    else:
        trial[key[0]][key[1]] = [value, value] if key == _BLOCK_KEY else value
    try:
        return hf_inventory(ModelConfig.from_hf_config(trial))
    except Exception:  # noqa: BLE001 - any failure means "not a candidate"; this is a probe, not a load
        return None


def _trial_values(value: int) -> list[int]:
    # One step either way finds counts (experts, layers, heads); doubling / halving keeps the
    # multiples of 32 that head and block sizes need.
    return [v for v in dict.fromkeys((value + 1, value - 1, value * 2, value // 2)) if v >= 0 and v != value]


def _explain_shape(raw: dict, name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> str:
    """Which config.json entries decide the dimensions in which tensor `name` differs from what the
    config implies, found by varying each integer entry and rebuilding the inventory (the mapping is
    the only place that knows the formulas), and which value of one would give the stored shape.
    Only runs on the way to an error: about a second per entry on the full release config."""
    if len(expected) != len(got):
        return ""
    differing = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    deciding: list[str] = []
    matching: list[str] = []
    for elements in (False, True):  # the elements of lists (per-layer entries) only when no scalar decides
        for key in _integer_keys(raw, elements=elements):
            value = _key_value(raw, key)
            shapes: dict[int, tuple[int, ...]] = {}
            for trial in _trial_values(value):
                inv = _inventory_with(raw, key, trial)
                shape = None if inv is None or name not in inv else inv[name].shape
                if shape is not None and len(shape) == len(expected):
                    moved = any(shape[i] != expected[i] for i in differing)
                    if not moved and not shapes:
                        break  # the first trial that builds leaves those dimensions alone: not this entry
                    shapes[trial] = shape
            if not any(any(sh[i] != expected[i] for i in differing) for sh in shapes.values()):
                continue
            deciding.append(_format_key(key, value))
            # A dimension is affine in one entry (ceil-divided for scales, hence every trial's
            # slope): solve on the first differing dimension, confirm with a rebuilt inventory.
            i = differing[0]
            candidates = [t for t, sh in shapes.items() if sh == got]
            for trial, shape in shapes.items():
                slope = (shape[i] - expected[i]) / (trial - value)
                if slope:
                    candidates.append(round(value + (got[i] - expected[i]) / slope))
            for candidate in dict.fromkeys(c for c in candidates if c >= 0 and c != value):
                inv = _inventory_with(raw, key, candidate)
                if inv is not None and name in inv and inv[name].shape == got:
                    matching.append(_format_key(key, candidate))
                    break
        if deciding:
            break
    if matching:
        return f"decided by config.json's {', '.join(deciding)}; {' or '.join(matching)} would match it"
    if deciding:
        return f"decided by config.json's {', '.join(deciding)}"
    return ""


def _explain_names(raw: dict, name: str, *, present: bool) -> str:
    """Which config.json entry decides whether tensor `name` exists: one whose variation makes it
    appear (present=True: the checkpoint has it, the config does not) or disappear."""
    for elements in (False, True):
        keys = _integer_keys(raw, elements=elements)
        for steps in (slice(0, 2), slice(2, 4)):  # one step first (counts), then doubling / halving
            for key in keys:
                value = _key_value(raw, key)
                for trial in _trial_values(value)[steps]:
                    inv = _inventory_with(raw, key, trial)
                    if inv is not None and (name in inv) == present:
                        return f"whether it is expected is decided by config.json's {_format_key(key, value)}"
    return ""


# ---------------------------------------------------------------------- reading
class _StreamReader:
    """One shard read front to back: header, then tensors in file order, every byte hashed once."""

    def __init__(self, path: Path, progress) -> None:
        self.path = path
        self.progress = progress
        self.sha = hashlib.sha256()
        self.fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        self.pos = 0
        (n,) = struct.unpack("<Q", self._read(8))
        header = json.loads(self._read(n))
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        # (name, begin, end), absolute offsets, in file order
        self.entries = sorted(
            (
                (k, self.data_start + v["data_offsets"][0], self.data_start + v["data_offsets"][1])
                for k, v in header.items()
            ),
            key=lambda e: e[1],
        )

    def close(self) -> None:
        self.fh.close()

    def _readinto(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            got = self.fh.readinto(view[done : done + READ_PIECE])
            if not got:
                raise ConversionError(
                    f"{self.path}: file ends at byte {self.pos + done}, expected at least "
                    f"{self.pos + len(view)} (truncated?)"
                )
            self.sha.update(view[done : done + got])
            done += got
            self.progress.update(got)
        self.pos += len(view)

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self._readinto(memoryview(buf))
        return bytes(buf)

    def skip_to(self, offset: int) -> None:
        """Read (and hash) up to `offset`: ignored tensors, gaps."""
        if offset < self.pos:
            raise ConversionError(f"{self.path}: overlapping tensor data at byte {offset}")
        scratch = np.empty(min(READ_PIECE, max(offset - self.pos, 1)), np.uint8)
        while self.pos < offset:
            n = min(len(scratch), offset - self.pos)
            self._readinto(memoryview(scratch)[:n])

    def read_into(self, name: str, begin: int, end: int, dest: np.ndarray) -> None:
        self.skip_to(begin)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        if len(view) != end - begin:
            raise ConversionError(
                f"{self.path}: tensor '{name}' holds {end - begin} bytes, expected {len(view)}"
            )
        self._readinto(view)

    def finish(self) -> str:
        size = os.fstat(self.fh.fileno()).st_size
        self.skip_to(size)
        return self.sha.hexdigest()


# ---------------------------------------------------------------------- dequantisation (bf16 mode)
def _dequantize_rows_into(weight: np.ndarray, scale: np.ndarray, block: int, out: np.ndarray) -> None:
    """FP8 rows with one ue8m0 per `block` columns (Engram tables) -> bf16 `out`, a slab at a time
    so the f32 temporary stays small."""
    rows, cols = weight.shape
    step = max(1, (64 << 20) // (4 * cols))
    for r in range(0, rows, step):
        f32 = np_dequant_fp8_weight(weight[r : r + step], scale[r : r + step], block, block_rows=1)
        out[r : r + step] = f32.astype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------------- groups
class _GroupBuilder:
    """Collects one group's tensors into its leaves. `destination` says where a tensor's stored
    bytes go (straight into the leaf when no conversion is needed), `filled` finishes it."""

    def __init__(self, group: _Group, plan: _Plan, weights_dtype: WeightsDtype) -> None:
        self.group = group
        self.plan = plan
        self.bf16 = weights_dtype == "bf16"
        self.remaining = set(group.names)
        self.leaves: dict[str, np.ndarray] = {}
        self.slots: dict[str, set[int]] = {}
        self.pending: dict[str, dict[str, np.ndarray]] = {}  # HF weight name -> {"weight", "scale"}

    def _leaf(self, path: str) -> np.ndarray:
        arr = self.leaves.get(path)
        if arr is None:
            spec = self.plan.targets[path]
            arr = self.leaves[path] = np.empty(spec.shape, spec.dtype)
        return arr

    def _needs_pairing(self, name: str) -> bool:
        spec = self.plan.inventory[name]
        return our_target(name).kind in ("wo_a", "wo_a_scale") or (self.bf16 and spec.quant is not None)

    def destination(self, name: str) -> np.ndarray:
        spec = self.plan.inventory[name]
        storage = STORAGE_DTYPES[spec.dtype]
        if self._needs_pairing(name):
            return np.empty(spec.shape, storage)
        t = our_target(name)
        leaf = self._leaf(t.path)
        if t.kind == "stack":
            return leaf[t.expert]
        if leaf.dtype != storage or leaf.shape != spec.shape:
            raise ConversionError(
                f"tensor '{name}': stored {spec.dtype} {list(spec.shape)} but the model's leaf {t.path} is "
                f"{leaf.dtype} {list(leaf.shape)}"
            )
        return leaf

    def filled(self, name: str, arr: np.ndarray) -> bool:
        """Record `name` as read into `arr`; True when the group is complete."""
        self.remaining.discard(name)
        spec = self.plan.inventory[name]
        t = our_target(name)
        if t.kind == "stack":
            self.slots.setdefault(t.path, set()).add(t.expert)
        if self._needs_pairing(name):
            pair = self.pending.setdefault(spec.weight_name, {})
            pair["scale" if spec.is_scale else "weight"] = arr
            if len(pair) == 2:
                del self.pending[spec.weight_name]
                self._dequantize(spec.weight_name, pair["weight"], pair["scale"])
        return not self.remaining

    def _dequantize(self, weight_name: str, weight: np.ndarray, scale: np.ndarray) -> None:
        spec = self.plan.inventory[weight_name]
        t = our_target(weight_name)
        block = self.plan.cfg.weight_block_size
        leaf = self._leaf(t.path)
        dest = leaf[t.expert] if t.kind == "stack" else leaf
        if spec.quant == "fp4":
            dest[...] = np_dequant_fp4_weight(weight, scale).astype(ml_dtypes.bfloat16)
        elif spec.quant == "fp8_rows":
            _dequantize_rows_into(weight, scale, block, dest)
        else:
            dest[...] = np_dequant_fp8_weight(weight, scale, block).astype(ml_dtypes.bfloat16)

    def finish(self) -> dict[str, np.ndarray]:
        """The group's leaves, each checked against the model's spec."""
        if self.pending or self.remaining:
            raise ConversionError(
                f"group {self.group.key}: incomplete (unpaired {sorted(self.pending)[:5]}, "
                f"unread {sorted(self.remaining)[:5]})"
            )
        if set(self.leaves) != self.group.targets:
            raise ConversionError(
                f"group {self.group.key}: produced {sorted(set(self.leaves) ^ self.group.targets)[:5]} "
                "differently from the plan"
            )
        for path, arr in self.leaves.items():
            spec = self.plan.targets[path]
            if tuple(arr.shape) != tuple(spec.shape) or arr.dtype != np.dtype(spec.dtype):
                raise ConversionError(
                    f"leaf {path}: got {arr.dtype} {list(arr.shape)}, the config needs "
                    f"{np.dtype(spec.dtype)} {list(spec.shape)}"
                )
            if path in self.slots and len(self.slots[path]) != spec.shape[0]:
                raise ConversionError(f"leaf {path}: {len(self.slots[path])} of {spec.shape[0]} experts read")
        return self.leaves


# ---------------------------------------------------------------------- helpers
def _release_memory() -> None:
    """Return freed group buffers to the OS: without this glibc keeps them and RSS creeps up."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def peak_rss_bytes() -> int:
    """VmHWM of this process (bytes): the peak resident set, anonymous + file-backed."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _orbax_context(compression: bool):
    import orbax.checkpoint as ocp

    ctx = ocp.v1.Context()
    ctx.array.saving.use_compression = compression
    # Orbax copies numpy leaves before writing unless told not to: that would double every group.
    # Safe here, because a group's arrays are not touched until its save has returned.
    ctx.memory.deepcopy_host_arrays = False
    # OCDBT keeps every encoded chunk of a save alive until the save's commit (measured: a 768 MB
    # bf16 leaf saved with zstd peaks at +540 MB, the compressed size, whatever the data file size
    # target; uncompressed chunks merely reference the group's arrays). So compressed checkpoints
    # use plain zarr3 (a directory per leaf, a file per chunk: +64 MB per chunk in flight), and
    # uncompressed ones OCDBT (few files). Restore reads either.
    ctx.array.saving.use_ocdbt = not compression
    # Chunks of at most CHUNK_BYTES, split along the largest axes (Orbax's greedy rule): a table or
    # the embedding is read a slab at a time. Routed experts [E, out, in] are chunked one expert each
    # instead, so a restore with experts sharded over devices reads only the experts it keeps.
    ctx.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
    per_expert = ocp.v1.options.ArrayOptions.Saving.StorageOptions(shard_axes=(0,))

    def storage_options(keypath, _value):
        keys = [getattr(k, "key", None) for k in keypath]
        return per_expert if "experts" in keys else None

    ctx.array.saving.scoped_storage_options_creator = storage_options
    return ctx


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        desc="convert",
        mininterval=0.5,
        dynamic_ncols=True,
    )


# ---------------------------------------------------------------------- the output directory
def _check_paths(hf_dir: str | Path, out_dir: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """Resolve `--hf-dir` / `--out` and refuse every output that a conversion could destroy without
    having written it (see the module docstring). Touches nothing."""
    for flag, value in (("--hf-dir", hf_dir), ("--out", out_dir)):
        if not str(value).strip():  # Path("") is the working directory
            raise ConversionError(f"{flag}: empty path; name a directory")
    hf = Path(hf_dir).resolve()  # Orbax wants absolute paths
    out = Path(out_dir).resolve()
    if not hf.is_dir():
        raise ConversionError(f"--hf-dir {hf}: not a directory")
    if out == hf or hf in out.parents:
        raise ConversionError(f"--out {out}: inside the source --hf-dir {hf}; write elsewhere")
    if out in hf.parents:
        raise ConversionError(f"--out {out}: contains the source --hf-dir {hf}; write elsewhere")
    for parent in out.parents:  # the nearest existing ancestor must be a directory to create OUT in
        if parent.exists():
            if not parent.is_dir():
                raise ConversionError(f"--out {out}: {parent} is a file, not a directory")
            break
    if not (out.exists() or out.is_symlink()):
        return hf, out
    if not overwrite:
        raise ConversionError(f"--out {out}: already exists; pass --overwrite to replace it")
    protected = _protected_directories()
    if out in protected:
        raise ConversionError(f"--out {out}: refusing to replace {protected[out]} with a checkpoint")
    _check_replaceable(out)
    return hf, out


def _protected_directories() -> dict[Path, str]:
    """Directories --overwrite never replaces, even when they look like a conversion: the root, the
    home and working directories, and every parent of those."""
    out: dict[Path, str] = {Path("/"): "the root directory"}
    places = [(Path.cwd(), "the working directory")]
    with contextlib.suppress(RuntimeError, KeyError):  # no home directory known: nothing to protect
        places.append((Path.home().resolve(), "the home directory"))
    for path, what in places:
        out.setdefault(path, what)
        for parent in path.parents:
            out.setdefault(parent, f"a parent of {what} {path}")
    return out


def _is_previous_conversion(directory: Path) -> bool:
    """A directory convert_weights wrote: its manifest names this converter's format (any version,
    so that a conversion by an older or newer build can be replaced too)."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _check_replaceable(out: Path) -> None:
    """--overwrite replaces a previous conversion or an empty directory, nothing else."""
    if out.is_symlink() or not out.is_dir():
        raise ConversionError(
            f"--out {out}: exists and is not a directory; --overwrite replaces only a previous conversion"
        )
    if _is_previous_conversion(out):
        return
    if any(out.iterdir()):
        raise ConversionError(
            f"--out {out}: not a previous conversion (no {MANIFEST_NAME} of format {FORMAT!r}) and not "
            "empty; --overwrite replaces only a directory convert_weights wrote"
        )


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), which tells a
    reused pid from the original; None where /proc is not available or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "pid (comm)" start at field 3


def _make_own_directory(parent: Path, prefix: str) -> Path:
    """A new directory `parent/<prefix><pid>-<random>` holding an owner marker. os.mkdir with mode
    0777 lets the umask decide the permissions, as for any directory the user makes (tempfile's
    0700 would leave a shared checkpoint unreadable to the group)."""
    while True:
        path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
            break
        except FileExistsError:
            continue
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid())}
    (path / OWNER_MARKER).write_text(json.dumps(owner) + "\n")
    return path


def _remove_own_directory(path: Path, settle_s: float = 5.0) -> None:
    """Remove a directory made by `_make_own_directory`, its owner marker last: if the removal is cut
    short, what remains is still recognisably ours and the next run finishes the job. A failed save's
    writer threads may still be creating files in it (a full disk: 2 of 6 runs left it behind, measured),
    so the removal is tried again for up to `settle_s` seconds while it does not go."""
    deadline = time.monotonic() + settle_s
    while _remove_own_directory_once(path) and time.monotonic() < deadline:
        time.sleep(0.1)


def _remove_own_directory_once(path: Path) -> bool:
    """One pass of `_remove_own_directory`; True if the directory is still there."""
    for child in list(path.iterdir()) if path.is_dir() else []:
        if child.name == OWNER_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
    marker = path / OWNER_MARKER
    owner = marker.read_bytes() if marker.is_file() else None
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError:  # something wrote into it meanwhile (an interrupted save's thread): leave it marked
        if owner is not None:
            marker.write_bytes(owner)
        return True
    return False


def _owner_is_gone(directory: Path) -> bool:
    """True when `directory` carries our owner marker and the process it names is certainly gone: same
    host, and no process with that pid, or one started at another time (the pid was reused). An
    unreadable marker, another host (a shared filesystem) or a live owner: False, keep it."""
    try:
        owner = json.loads((directory / OWNER_MARKER).read_text())
        pid, host, start = int(owner["pid"]), owner["host"], owner["start"]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return start is not None and _process_start(pid) not in (None, start)


def _remove_stale_temporaries(out: Path) -> list[str]:
    """Remove what killed conversions to `out` left beside it (see `_owner_is_gone`). A `.replaced-`
    directory of a run killed between moving the old OUT aside and moving the new one in still holds
    the previous conversion: it goes back to OUT when OUT is missing. Returns the names removed."""
    removed: list[str] = []
    if not out.parent.is_dir():
        return removed
    for kind in ("converting", "replaced"):
        for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
            if not path.is_dir() or path.is_symlink() or not _owner_is_gone(path):
                continue
            previous = path / "old"
            if kind == "replaced" and previous.is_dir() and not (out.exists() or out.is_symlink()):
                os.rename(previous, out)
            _remove_own_directory(path)
            removed.append(path.name)
    return removed


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory onto `out`; a replaced `out` (checked again: hours
    may have passed since the start) is removed only after the new one is in place. The owner
    marker goes first: the checkpoint is no temporary directory."""
    (tmp / OWNER_MARKER).unlink()
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        return
    _check_replaceable(out)
    old = _make_own_directory(out.parent, f".{out.name}.replaced-")
    os.rename(out, old / "old")
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / "old", out)
        raise
    finally:
        if out.exists():
            _remove_own_directory(old)


# ---------------------------------------------------------------------- entry point
def convert(hf_dir: str | Path, out_dir: str | Path, options: ConvertOptions | None = None) -> dict:
    """Convert `hf_dir` into `out_dir` (see the module docstring). Returns a summary dict; raises
    ConversionError (a ValueError) with the offending file / tensor named, leaving nothing behind."""
    options = options or ConvertOptions()
    start = time.perf_counter()
    if options.engram not in ("separate", "inline", "skip"):
        raise ConversionError(f"--engram: expected separate, inline or skip, got {options.engram!r}")
    if options.weights_dtype not in ("native", "bf16"):
        raise ConversionError(f"--weights-dtype: expected native or bf16, got {options.weights_dtype!r}")
    if options.include is not None:
        _check_include(options.include)
    hf, out = _check_paths(hf_dir, out_dir, options.overwrite)
    try:
        cfg = ModelConfig.from_pretrained(hf)
    except ConfigError as e:
        raise ConversionError(f"{hf / 'config.json'}: {e}") from None
    except FileNotFoundError:
        raise ConversionError(f"{hf}: no config.json") from None
    if options.include is None:
        include = default_include(cfg, read_index_json(hf)["weight_map"], hf / INDEX_NAME)
    else:
        include = _check_include(options.include)
    _check_parts_described(cfg, include, hf / "config.json")
    _check_fp4_dims(cfg, hf / "config.json")
    plan = _plan(hf, cfg, options, include)

    out.parent.mkdir(parents=True, exist_ok=True)
    stale = _remove_stale_temporaries(out)
    tmp = _make_own_directory(out.parent, f".{out.name}.converting-")
    try:
        summary = _write(plan, hf, tmp, options, include)
        _check_interrupt()  # the last point at which OUT is still the previous conversion
        _move_into_place(tmp, out)
    except BaseException:
        _remove_own_directory(tmp)
        raise
    seconds = time.perf_counter() - start
    source_bytes = sum(plan.file_sizes.values())
    summary.update(
        out=str(out),
        seconds=round(seconds, 3),
        source_gb_per_s=round(source_bytes / seconds / 1e9, 4),
        peak_rss_bytes=peak_rss_bytes(),
        stale_temporaries_removed=stale,
    )
    return summary


def _write(plan: _Plan, hf: Path, tmp: Path, options: ConvertOptions, include: tuple[str, ...]) -> dict:
    import orbax.checkpoint as ocp

    total_bytes = sum(plan.file_sizes.values())
    n_tensors = len(plan.weight_map)
    bar = _progress_bar(total_bytes, options.progress)
    builders: dict[str, _GroupBuilder] = {}
    produced: dict[str, dict] = {}
    items_used: dict[str, dict] = {}
    raw_leaves: dict[str, dict] = {}
    write_engram_raw = (
        options.engram_raw and options.engram == "separate" and options.weights_dtype == "native"
    )
    sources: list[dict] = []
    done_tensors = 0
    consumed = 0
    quiet = QuietNonOcdbtMerge()
    logging.getLogger("absl").addFilter(quiet)
    try:
        with _orbax_context(options.compression):
            for file in plan.files:
                reader = _StreamReader(hf / file, bar)
                try:
                    for name, begin, end in reader.entries:
                        _check_interrupt()  # between tensors: never inside a read or an Orbax save
                        key = plan.group_of.get(name)
                        if key is None:  # ignored: read only to hash it
                            reader.skip_to(end)
                        else:
                            builder = builders.get(key)
                            if builder is None:
                                builder = builders[key] = _GroupBuilder(
                                    plan.groups[key], plan, options.weights_dtype
                                )
                            dest = builder.destination(name)
                            reader.read_into(name, begin, end, dest)
                            consumed += 1
                            if builder.filled(name, dest):
                                del dest
                                bar.set_postfix_str(f"tensors {done_tensors + 1}/{n_tensors}, saving {key}")
                                leaves = builders.pop(key).finish()
                                group = plan.groups[key]
                                ocp.v1.partial.save(tmp / group.item, nest(leaves))
                                if write_engram_raw and group.item == ENGRAM_ITEM:
                                    for path, arr in leaves.items():
                                        write_raw(tmp / RAW_DIR, plan.cfg, path, arr)
                                        raw_leaves[path] = {
                                            "file": f"{RAW_DIR}/{path}.bin",
                                            "bytes": arr.nbytes,
                                        }
                                info = items_used.setdefault(group.item, {"leaves": 0, "bytes": 0})
                                for path, arr in leaves.items():
                                    produced[path] = {
                                        "item": group.item,
                                        "shape": list(arr.shape),
                                        "dtype": str(arr.dtype),
                                    }
                                    info["leaves"] += 1
                                    info["bytes"] += arr.nbytes
                                del leaves, builder
                                _release_memory()
                        done_tensors += 1
                        bar.set_postfix_str(f"tensors {done_tensors}/{n_tensors}", refresh=False)
                    digest = reader.finish()
                finally:
                    reader.close()
                sources.append({"file": file, "bytes": plan.file_sizes[file], "sha256": digest})
            if builders:
                raise ConversionError(f"groups never completed: {sorted(builders)[:5]}")
            missing = sorted(set(plan.targets) - set(produced))
            if missing:
                raise ConversionError(f"{len(missing)} model leaves were not produced, e.g. {missing[:5]}")
            _check_interrupt()
            for item in items_used:
                bar.set_postfix_str(f"finalizing {item}")
                ocp.v1.partial.finalize(tmp / item)
            bar.set_postfix_str(f"tensors {done_tensors}/{n_tensors}, done")
    finally:
        logging.getLogger("absl").removeFilter(quiet)
        bar.close()

    for name in (INDEX_NAME, *COPIED_FILES):
        src = hf / name
        if not src.is_file():
            continue
        if name != INDEX_NAME:
            shutil.copyfile(src, tmp / name)
        sources.append({"file": name, "bytes": src.stat().st_size, "sha256": file_sha256(src)})
    largest = max(plan.groups.values(), key=lambda g: g.out_bytes)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "converter": {"name": "convert_weights", "version": CONVERTER_VERSION, "package": _package_version()},
        "options": {
            "include": list(include),
            "engram": options.engram,
            "weights_dtype": options.weights_dtype,
            "compression": options.compression,
        },
        "model": plan.cfg.name,
        "items": {k: {"path": k, **v} for k, v in sorted(items_used.items())},
        "sources": sources,
        "tensors": {
            "source": n_tensors,
            "consumed": consumed,
            "folded_scales": plan.folded,
            "ignored": [{"name": n, "reason": r} for n, r in sorted(plan.ignored.items())],
        },
        "leaves": dict(sorted(produced.items())),
    }
    if raw_leaves:
        manifest["engram_raw"] = {"path": RAW_DIR, "leaves": dict(sorted(raw_leaves.items()))}
    if consumed + len(plan.ignored) != n_tensors:
        raise ConversionError(
            f"coverage: {consumed} tensors consumed + {len(plan.ignored)} ignored != {n_tensors} in the index"
        )
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return {
        "tensors": n_tensors,
        "consumed": consumed,
        "ignored": len(plan.ignored),
        "leaves": len(produced),
        "items": sorted(items_used),
        "source_bytes": total_bytes,
        "written_bytes": sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()),
        "largest_group": largest.key,
        "largest_group_bytes": largest.out_bytes,
    }


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ced-jax")
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------- command line
def run(args: argparse.Namespace) -> int:
    """Run a conversion from the parsed `ced-jax convert` / `convert_weights` arguments (defined in
    ced_cli.convert); prints a JSON summary on stdout."""
    prog = getattr(args, "prog", "convert_weights")
    options = ConvertOptions(
        include=None if getattr(args, "include", None) is None else tuple(args.include.split(",")),
        engram=args.engram,
        weights_dtype=args.weights_dtype,
        overwrite=args.overwrite,
        progress=not args.quiet,
        compression=not args.no_compression,
        engram_raw=not getattr(args, "no_engram_raw", False),
    )
    try:
        with _signals_interrupt(), closed_loop_tracebacks_dropped():
            summary = convert(args.hf_dir, args.out, options)
    except OSError as e:  # disk full, permissions: one line, like every other user-facing error
        raise ConversionError(f"{e.filename or args.out}: {e.strerror or e}") from None
    except _Interrupted as e:
        # convert() has removed its temporary directory on the way out (it re-raises after clean-up).
        print(
            f"{prog}: interrupted by {signal.Signals(e.signum).name}; --out {args.out} left as it was, "
            "temporary files removed",
            file=sys.stderr,
        )
        return 128 + e.signum  # the shell's status for a process ended by that signal
    print(json.dumps(summary))
    return 0


class _Interrupted(BaseException):
    """SIGTERM or SIGINT (Ctrl-C) during a conversion, raised by `_check_interrupt` between tensors. A
    BaseException, so that no `except Exception` swallows it and convert()'s clean-up runs as for any
    failure. Not KeyboardInterrupt: with it,
    a Ctrl-C'd `ced-jax convert` printed this message and returned 130, yet the process still ended
    by SIGINT (status -2, measured); CPython re-sends SIGINT at exit once it has seen an unhandled
    KeyboardInterrupt, apparently somewhere inside the save's own event loop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The first SIGTERM / SIGINT received while converting (None: none). The handler only records it:
# an exception raised from a handler can land anywhere, a garbage-collection callback included, where
# Python prints it as "ignored" and the conversion would go on to replace OUT; and raised inside an
# Orbax save it leaves the save's writer threads writing into the directory being removed.
_received_signal: int | None = None


def _check_interrupt() -> None:
    if _received_signal is not None:
        raise _Interrupted(_received_signal)


@contextlib.contextmanager
def _signals_interrupt():
    """While converting, SIGTERM and SIGINT stop the conversion at the next tensor (`_check_interrupt`;
    Python's default for SIGTERM is to die on the spot, leaving the temporary directory behind).
    Further signals change nothing; SIGKILL still ends it, and the next run removes what is left."""
    global _received_signal
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    signums = (signal.SIGTERM, signal.SIGINT)

    def record(signum, frame):
        global _received_signal
        if _received_signal is None:
            _received_signal = signum
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after the current tensor\n".encode())

    _received_signal = None
    previous = {s: signal.signal(s, record) for s in signums}
    try:
        yield
    finally:
        stopping = _received_signal is not None
        for s, handler in previous.items():
            # Interrupted: the process is about to exit 128 + signal; a further Ctrl-C must not turn
            # that into a KeyboardInterrupt traceback. None: a handler set outside Python.
            signal.signal(s, signal.SIG_IGN if stopping else signal.SIG_DFL if handler is None else handler)
        _received_signal = None


__all__ = [
    "CONVERTER_VERSION",
    "ConversionError",
    "ConvertOptions",
    "convert",
    "run",
]
