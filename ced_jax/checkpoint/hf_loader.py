"""Load a released-layout DeepSeek-V4.1 HF checkpoint (index + safetensors shards) into our params.

`load_hf_checkpoint(directory, cfg)` returns `(params, report)`: `params` maps our parameter paths
(see `ced_jax.checkpoint.mapping`) to numpy arrays in our storage dtypes, with the stored bytes unchanged
except where the mapping says otherwise (experts stacked, `attn.wo_a` dequantised to bf16).

Conventions
- Everything is validated before any tensor data is read: config.json against `cfg`, the index
  against the inventory (`mapping.hf_inventory`), every shard's header against the index and the
  inventory. Every failure is a `CheckpointError` that names the tensor and/or file and gives the
  expected and the actual value.
- Reading: safetensors 0.8 with framework="numpy" returns F32 as float32, BF16 as bfloat16 (once
  ml_dtypes is imported, which registers the dtype name) and I8 as int8 (reinterpreted as uint8:
  the same bytes). It cannot return F8_E4M3 / F8_E8M0 at all: it looks up `numpy.float8_e4m3fn` /
  `numpy.float8_e8m0fnu`, which numpy does not have. Those two are read as raw bytes from the
  offsets in the shard header (after safe_open has validated the file) and viewed as
  float8_e4m3fn / uint8, so no value is converted.
- Memory: one tensor is read at a time (safe_open maps the file; raw reads read one byte range).
  Stacked experts are preallocated once and filled slot by slot.
- `mtp.*` (DSpark) tensors are read with `include=("text", "dspark")` (our paths `mtp.{k}...`, mapped
  like backbone layers); otherwise they and the vision tensors are recognised and skipped, each
  listed in `report.skipped` (the vision encoder reads its own group with
  `ced_jax.checkpoint.vision.load_vision_params`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes  # also registers "bfloat16" with numpy, which safetensors' numpy reader needs
import numpy as np
from safetensors import SafetensorError, safe_open

from ced_jax.checkpoint.mapping import (
    GROUPS,
    ITEMSIZE,
    LOADABLE_GROUPS,
    SKIP_NOTES,
    STORAGE_DTYPES,
    TEXT_GROUPS,
    TensorSpec,
    hf_inventory,
    optional_group_of,
    our_param_specs,
    our_target,
)
from ced_jax.config import ConfigError, ModelConfig
from pallas_kernels.formats import np_dequant_fp8_weight

INDEX_NAME = "model.safetensors.index.json"
_RAW_DTYPES = ("F8_E4M3", "F8_E8M0")  # safetensors' numpy reader cannot build these


class CheckpointError(ValueError):
    """A checkpoint that does not match the inventory of the given config, or cannot be read."""


@dataclass
class LoadReport:
    directory: str
    config_checked: bool = False
    tensors_read: int = 0
    bytes_read: int = 0
    shards: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (HF name, why)
    consumed: list[str] = field(default_factory=list)  # scales folded into a dequantised weight
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- small readers
def read_index_json(directory: Path) -> dict:
    path = directory / INDEX_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing index file (expected {INDEX_NAME} in {directory})")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{path}: expected a 'weight_map' object of tensor name -> file name")
    return index


def read_index(directory: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), validated for form."""
    return read_index_json(Path(directory))["weight_map"]


def _read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(data start offset, header entries) of a safetensors file already validated by safe_open."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


class Shard:
    """One open shard: safe_open for validation and the dtypes it can read, raw reads for F8."""

    def __init__(self, directory: Path, file: str) -> None:
        self.path = directory / file
        self.file = file
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: shard file missing (named in {INDEX_NAME})")
        try:
            self._st = safe_open(str(self.path), framework="numpy")
            self._st.__enter__()
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{self.path}: cannot read safetensors file ({e}); truncated or corrupt?"
            ) from None
        self._raw: tuple[int, dict[str, dict]] | None = None
        self._fh = None

    def close(self) -> None:
        self._st.__exit__(None, None, None)
        if self._fh is not None:
            self._fh.close()

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._st.offset_keys())  # file order: sequential reads

    def dtype_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        sl = self._st.get_slice(name)
        return sl.get_dtype(), tuple(sl.get_shape())

    def raw_bytes(self, name: str) -> np.ndarray:
        """The tensor's stored bytes (little-endian, as in the file), as a flat uint8 array."""
        if self._raw is None:
            self._raw = _read_header(self.path)
            self._fh = open(self.path, "rb")  # closed in close()
        start, header = self._raw
        begin, end = header[name]["data_offsets"]
        buf = np.empty(end - begin, dtype=np.uint8)
        self._fh.seek(start + begin)
        if self._fh.readinto(memoryview(buf)) != end - begin:
            raise CheckpointError(f"{self.path}: tensor '{name}' ends past the end of the file")
        return buf

    def read(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor in our storage dtype, bytes unchanged."""
        storage = STORAGE_DTYPES[dtype]
        try:
            if dtype in _RAW_DTYPES:
                arr = self.raw_bytes(name).view(storage).reshape(shape)
            else:
                arr = self._st.get_tensor(name)
                if arr.dtype.itemsize != storage.itemsize:
                    raise CheckpointError(f"{self.path}: '{name}' read as {arr.dtype}, expected {storage}")
                arr = np.ascontiguousarray(arr).view(storage)
        except SafetensorError as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{name}' ({e})") from None
        return arr


# ---------------------------------------------------------------------- conversion steps
class ParamAssembler:
    """Turns HF tensors (storage dtypes, any order) into our param tree: copies, expert stacking,
    the wo_a dequantisation. Shared by the loader and `ced_jax.testing.random_weights`."""

    def __init__(self, cfg: ModelConfig, groups: Iterable[str] = TEXT_GROUPS) -> None:
        self.cfg = cfg
        self.specs = our_param_specs(cfg, tuple(groups))
        self.params: dict[str, np.ndarray] = {}
        self._stacked: dict[str, set[int]] = {}
        self._wo_a: dict[str, dict[str, np.ndarray]] = {}

    def add(self, hf_name: str, arr: np.ndarray) -> None:
        t = our_target(hf_name)
        if t.kind == "copy":
            self.params[t.path] = arr
        elif t.kind == "stack":
            buf = self.params.get(t.path)
            if buf is None:
                shape, dtype = self.specs[t.path]
                buf = self.params[t.path] = np.empty(shape, dtype)
            buf[t.expert] = arr
            self._stacked.setdefault(t.path, set()).add(t.expert)
        else:
            pending = self._wo_a.setdefault(t.path, {})
            pending["weight" if t.kind == "wo_a" else "scale"] = arr
            if len(pending) == 2:
                # As DeepSeek's convert.py does for wo_a; exact in f32 and in bf16 (4 significant bits
                # times a power of two).
                w = np_dequant_fp8_weight(pending["weight"], pending["scale"], self.cfg.weight_block_size)
                self.params[t.path] = w.astype(ml_dtypes.bfloat16)
                del self._wo_a[t.path]

    def finish(self) -> dict[str, np.ndarray]:
        incomplete = sorted(self._wo_a)
        for path, seen in self._stacked.items():
            if len(seen) != self.specs[path][0][0]:
                incomplete.append(f"{path} (experts {len(seen)} of {self.specs[path][0][0]})")
        missing = sorted(set(self.specs) - set(self.params))
        if incomplete or missing:
            raise CheckpointError(
                f"incomplete parameters: missing {missing[:10]}, incomplete {incomplete[:10]}"
            )
        return self.params


# ---------------------------------------------------------------------- validation
def _resolve_include(include: Iterable[str], cfg: ModelConfig) -> tuple[str, ...]:
    groups: list[str] = []
    for item in include:
        names = TEXT_GROUPS if item == "text" else (item,)
        for g in names:
            if g not in GROUPS:
                raise ValueError(f"include: unknown group {g!r}; known: 'text', {list(GROUPS)}")
            if g not in LOADABLE_GROUPS:
                raise NotImplementedError(f"include: {SKIP_NOTES[g]}")
            if g == "dspark" and cfg.num_nextn_predict_layers <= 0:
                raise ValueError(
                    "include 'dspark': the config's num_nextn_predict_layers is 0, "
                    "it describes no DSpark stages"
                )
            if g not in groups:
                groups.append(g)
    return tuple(groups)


def _check_config(directory: Path, cfg: ModelConfig, report: LoadReport) -> None:
    if not (directory / "config.json").is_file():
        report.notes.append(
            "no config.json in the checkpoint; checked against the given config's inventory only"
        )
        return
    try:
        found = ModelConfig.from_pretrained(directory)
    except ConfigError as e:
        raise CheckpointError(f"{directory / 'config.json'}: {e}") from None
    diffs = [
        f"{f.name}: expected {getattr(cfg, f.name)!r}, config.json has {getattr(found, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.compare and getattr(cfg, f.name) != getattr(found, f.name)
    ]
    if diffs:
        raise CheckpointError(
            f"{directory / 'config.json'}: config mismatch with the given ModelConfig: " + "; ".join(diffs)
        )
    report.config_checked = True


def classify_tensors(
    weight_map: dict[str, str], inventory: dict[str, TensorSpec], groups: tuple[str, ...], report: LoadReport
) -> dict[str, list[str]]:
    """Shard file -> names in it that are checked against the inventory (all known ones)."""
    where = Path(report.directory) / INDEX_NAME
    unknown = sorted(n for n in weight_map if n not in inventory and optional_group_of(n) is None)
    if unknown:
        raise CheckpointError(
            f"{where}: {len(unknown)} unknown tensor(s), not in the inventory of this config and not in "
            "a recognised optional group: " + ", ".join(f"'{n}' (in {weight_map[n]})" for n in unknown[:10])
        )
    missing = [s for s in inventory.values() if s.group in groups and s.name not in weight_map]
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} missing tensor(s): "
            + ", ".join(f"'{s.name}' (expected {s.dtype} {list(s.shape)})" for s in missing[:10])
        )
    by_shard: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        spec = inventory.get(name)
        if spec is None:
            group = optional_group_of(name)
            report.skipped.append((name, f"{SKIP_NOTES[group]} (not described by this config)"))
            continue
        if spec.group not in groups:
            note = SKIP_NOTES.get(spec.group, f"group {spec.group!r} not requested (include={list(groups)})")
            report.skipped.append((name, note))
        by_shard.setdefault(file, []).append(name)
    return by_shard


def check_shard_header(shard: Shard, names: list[str], inventory: dict[str, TensorSpec]) -> None:
    present = set(shard.keys())
    for name in names:
        if name not in present:
            raise CheckpointError(
                f"{shard.path}: tensor '{name}' is in {INDEX_NAME} for this file but absent from it"
            )
        spec = inventory[name]
        dtype, shape = shard.dtype_shape(name)
        if dtype != spec.dtype:
            raise CheckpointError(
                f"{shard.path}: tensor '{name}': wrong dtype, expected {spec.dtype}, got {dtype}"
            )
        if shape != spec.shape:
            raise CheckpointError(
                f"{shard.path}: tensor '{name}': wrong shape, expected {list(spec.shape)}, got {list(shape)}"
            )


# ---------------------------------------------------------------------- entry points
def load_hf_checkpoint(
    directory: str | Path, cfg: ModelConfig, *, include: Iterable[str] = ("text",)
) -> tuple[dict[str, np.ndarray], LoadReport]:
    """Read, validate and convert a checkpoint. `include`: "text" (= "backbone" + "engram_table"),
    or those groups one by one (e.g. ("backbone",) to leave the large Engram tables on disk), plus
    "dspark" for the DSpark stages (paths `mtp.{k}....`; every one must be present)."""
    directory = Path(directory)
    groups = _resolve_include(include, cfg)
    report = LoadReport(str(directory))
    _check_config(directory, cfg, report)
    index = read_index_json(directory)
    weight_map = index["weight_map"]
    inventory = hf_inventory(cfg)
    by_shard = classify_tensors(weight_map, inventory, groups, report)
    report.shards = sorted(set(weight_map.values()))

    # Pass 1: headers only, so a bad file is reported before gigabytes are read.
    for file in report.shards:
        with Shard(directory, file) as shard:
            check_shard_header(shard, by_shard.get(file, []), inventory)
    meta = index.get("metadata")
    declared = meta.get("total_size") if isinstance(meta, dict) else None
    payload = sum(inventory[n].nbytes for names in by_shard.values() for n in names)
    skipped_unknown = [n for n, _ in report.skipped if n not in inventory]
    if declared is not None and not skipped_unknown and declared != payload:
        report.notes.append(f"index metadata.total_size is {declared}, the tensors hold {payload} bytes")

    # Pass 2: data, one tensor at a time.
    assembler = ParamAssembler(cfg, groups)
    for file in report.shards:
        wanted = {n for n in by_shard.get(file, []) if inventory[n].group in groups}
        if not wanted:
            continue
        with Shard(directory, file) as shard:
            for name in shard.keys():
                if name not in wanted:
                    continue
                spec = inventory[name]
                assembler.add(name, shard.read(name, spec.dtype, spec.shape))
                report.tensors_read += 1
                report.bytes_read += spec.nbytes
                if our_target(name).kind == "wo_a_scale":
                    report.consumed.append(name)
    return assembler.finish(), report


def load_group_file(path: str | Path, cfg: ModelConfig, group: str = "dspark") -> dict[str, np.ndarray]:
    """One safetensors file holding exactly the tensors of `group` (released names and dtypes, e.g. a
    DSpark draft trained for a preset) -> our params of that group (flat paths, as
    `load_hf_checkpoint` gives them). Every tensor is checked against `cfg`'s inventory; a missing,
    extra or mis-shaped one is a CheckpointError naming it."""
    path = Path(path)
    groups = _resolve_include((group,), cfg)
    wanted = {n: s for n, s in hf_inventory(cfg).items() if s.group in groups}
    assembler = ParamAssembler(cfg, groups)
    with Shard(path.parent, path.name) as shard:
        present = shard.keys()
        extra = sorted(set(present) - set(wanted))
        missing = [n for n in wanted if n not in present]
        if extra or missing:
            raise CheckpointError(
                f"{path}: expected exactly the {len(wanted)} '{group}' tensors of this config; "
                f"missing {missing[:5]}, unexpected {extra[:5]}"
            )
        check_shard_header(shard, present, wanted)
        for name in present:
            spec = wanted[name]
            assembler.add(name, shard.read(name, spec.dtype, spec.shape))
    return assembler.finish()


def iter_raw_tensors(
    directory: str | Path, names: Iterable[str] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, stored bytes as flat uint8) for the given names (default: all, name-sorted), one
    tensor in memory at a time. Name order jumps between shards, so each shard stays open (mapped,
    not read) until the end."""
    directory = Path(directory)
    weight_map = read_index(directory)
    shards: dict[str, tuple[Shard, set[str]]] = {}
    try:
        for name in sorted(weight_map) if names is None else names:
            file = weight_map[name]
            if file not in shards:
                shard = Shard(directory, file)
                shards[file] = (shard, set(shard.keys()))
            shard, present = shards[file]
            if name not in present:
                raise CheckpointError(
                    f"{shard.path}: tensor '{name}' is in {INDEX_NAME} but absent from the file"
                )
            dtype, shape = shard.dtype_shape(name)
            raw = shard.raw_bytes(name)
            if raw.size != math.prod(shape) * ITEMSIZE.get(dtype, 0):
                raise CheckpointError(
                    f"{shard.path}: tensor '{name}' has {raw.size} bytes for {dtype} {list(shape)}"
                )
            yield name, raw
    finally:
        for shard, _ in shards.values():
            shard.close()


def content_sha256(directory: str | Path) -> str:
    """SHA-256 over the raw little-endian bytes of every tensor, concatenated in name-sorted order
    (the layout-independent checkpoint hash used by bench/configs/mid/README.md)."""
    h = hashlib.sha256()
    for _, raw in iter_raw_tensors(directory):
        h.update(raw.data)
    return h.hexdigest()
