"""The validation pass: what a conversion will read and write, checked before any tensor data is read.

The index is checked against the inventory of the config (`mapping.hf_inventory`), every shard's
header against the index and the inventory, and stray shards the index does not mention. Every
failure is a `ConversionError` naming the tensor / file. The result, a `Plan`, groups the tensors
into the units `conversion.write` saves one at a time (a layer, one Engram table, the embedding, the
final norm + head).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ced_jax.checkpoint.converted import OPTIONAL_PARTS, WeightsDtype, item_of, target_specs
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
    TEXT_GROUPS,
    TensorSpec,
    hf_inventory,
    optional_group_of,
    our_param_specs,
    our_target,
)
from ced_jax.config import ModelConfig
from ced_jax.model import ParamSpec
from conversion.explain import explain_names, explain_shape
from conversion.options import INCLUDE_CHOICES, ConversionError, ConvertOptions

_PART_LABEL = {
    "dspark": "DSpark draft stage tensor (mtp.*)",
    "vision": "vision tower / aligner / image delimiter tensor",
}


@dataclass
class Group:
    """HF tensors saved together, in one `partial.save` into the Orbax item `item`."""

    key: str
    item: str
    names: list[str] = field(default_factory=list)  # HF tensors consumed
    targets: set[str] = field(default_factory=set)  # leaves produced
    out_bytes: int = 0


@dataclass
class Plan:
    """What a conversion will read (files, tensors) and write (leaves, by group), validated."""

    cfg: ModelConfig
    inventory: dict[str, TensorSpec]
    weight_map: dict[str, str]
    files: list[str]
    file_sizes: dict[str, int]
    targets: dict[str, ParamSpec]
    groups: dict[str, Group]
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


def check_include(include: Iterable[str]) -> tuple[str, ...]:
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
    which is when `ced_jax.load(with_draft=None)` reads them from the HF directory, so the conversion
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


def check_parts_described(cfg: ModelConfig, include: tuple[str, ...], config_path: Path) -> None:
    if "dspark" in include and cfg.num_nextn_predict_layers == 0:
        raise ConversionError(
            f"--include dspark: {config_path} describes no DSpark stages (num_nextn_predict_layers is 0)"
        )
    if "vision" in include and cfg.vision is None:
        raise ConversionError(f"--include vision: {config_path} has no vision_config")


def check_fp4_dims(cfg: ModelConfig, config_path: Path) -> None:
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


def make_plan(hf_dir: Path, cfg: ModelConfig, options: ConvertOptions, include: tuple[str, ...]) -> Plan:
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
        hint = name and explain_names(_raw_config(hf_dir), name, present=bool(unknown))
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
                    hint = explain_shape(_raw_config(hf_dir), name, expected, got)
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
    groups: dict[str, Group] = {}
    group_of: dict[str, str] = {}
    folded: list[str] = []
    for name in weight_map:
        if name in ignored:
            continue
        spec = inventory[name]
        key = _group_key(name, spec)
        path = _target_path(name, spec, options.weights_dtype)
        item = item_of(path or our_target(spec.weight_name).path, options.engram)
        group = groups.setdefault(key, Group(key, item))
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
    return Plan(
        cfg, inventory, weight_map, files, file_sizes, targets, groups, group_of, ignored, sorted(folded)
    )
