"""A converted checkpoint (the output of `conversion.convert`): its layout, and reading it back.

The converter writes and the model reads the same layout, declared here once:
- `ced_manifest.json` (`MANIFEST_NAME`) beside Orbax items: `params/` (our parameter tree, nested
  dicts keyed by the dotted path), `engram/` (the Engram hash tables, when written separately), and
  `dspark/`, `vision/` (optional parts, host memory only);
- `target_specs`: the leaves a conversion with given options produces (shape, numpy dtype, logical
  axes), `item_of`: which item a leaf goes to; `nest` / `flatten` between dotted paths and the
  Orbax tree.

`restore` reads a checkpoint onto a mesh or into host memory, `load_flat` into one flat numpy dict
(what `ced_jax.load` takes). Both check every leaf against the config's specs before reading data;
each failure is a `CheckpointError` naming the file or leaf. The model package reads checkpoints
itself, so it never imports the converter.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ced_jax.checkpoint.hf_loader import CheckpointError
from ced_jax.checkpoint.mapping import STORAGE_DTYPES, is_engram_table, optional_group_of
from ced_jax.config import ConfigError, ModelConfig
from ced_jax.model import BF16, FP4X2, ParamSpec, dspark_param_specs, flatten_specs, param_specs
from ced_jax.trees import flatten, nest
from ced_jax.vision.params import vision_param_specs

FORMAT = "ced-jax/orbax"
FORMAT_VERSION = 1
MANIFEST_NAME = "ced_manifest.json"
PARAMS_ITEM = "params"
ENGRAM_ITEM = "engram"
OPTIONAL_PARTS = ("dspark", "vision")  # = their Orbax item names (and their mapping groups)

# Orbax's in-flight read budget when restoring onto a mesh: the largest leaf plus this (see _restore_item).
READ_SLACK_BYTES = 16 << 20

EngramMode = Literal["separate", "inline", "skip"]
WeightsDtype = Literal["native", "bf16"]


# ---------------------------------------------------------------------- target tree
def part_specs(cfg: ModelConfig, part: str) -> dict[str, ParamSpec]:
    """Native leaves of an optional part (`dspark` / `vision`): the DSpark stages' tree or the vision
    tower's, in their storage dtypes. Logical axes are all None: these items live in host memory."""
    if part == "dspark":
        stages = flatten_specs(dspark_param_specs(cfg)).items()
        return {name: ParamSpec(s.shape, np.dtype(s.dtype), s.axes) for name, s in stages}
    return {
        name: ParamSpec(shape, STORAGE_DTYPES[dtype], (None,) * len(shape))
        for name, (shape, dtype) in vision_param_specs(cfg).items()
    }


def target_specs(
    cfg: ModelConfig,
    *,
    weights_dtype: WeightsDtype = "native",
    engram: EngramMode = "separate",
    include: Iterable[str] = ("text",),
) -> dict[str, ParamSpec]:
    """The leaves a conversion produces: dotted path -> ParamSpec (shape, numpy dtype, logical axes).

    native: `ced_jax.model.param_specs` as is, plus `part_specs` of each included optional part.
    bf16: each quantised weight (one with a `.scale` sibling) becomes a bf16 leaf of its logical
    shape (packed FP4 unpacked), and its scale goes."""
    flat = flatten_specs(param_specs(cfg))
    for part in include:
        if part in OPTIONAL_PARTS:
            flat.update(part_specs(cfg, part))
    out: dict[str, ParamSpec] = {}
    for path, spec in flat.items():
        if engram == "skip" and is_engram_table(path):
            continue
        if weights_dtype == "bf16":
            stem = path.rsplit(".", 1)[0]
            if path.endswith(".scale") and f"{stem}.weight" in flat:
                continue
            if path.endswith(".weight") and f"{stem}.scale" in flat:
                shape = spec.shape
                if np.dtype(spec.dtype) == np.dtype(FP4X2):
                    shape = (*shape[:-1], shape[-1] * 2)
                spec = ParamSpec(shape, BF16, spec.axes)
        out[path] = spec
    return out


def item_of(path: str, engram: EngramMode) -> str:
    part = optional_group_of(path)
    if part is not None:
        return part
    return ENGRAM_ITEM if engram == "separate" and is_engram_table(path) else PARAMS_ITEM


def is_converted_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST_NAME).is_file()


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')}, "
            f"this build reads {FORMAT!r} v{FORMAT_VERSION}"
        )
    return manifest


@dataclass
class Restored:
    """A converted checkpoint in memory: `params` (nested; device arrays when a mesh was given, else
    numpy) and `engram` (nested numpy tables in host memory when written as a separate item, else
    None: inline tables are in `params`); `parts`: the included optional parts ("dspark",
    "vision"), nested numpy, always in host memory."""

    cfg: ModelConfig
    manifest: dict
    params: dict
    engram: dict | None
    parts: dict[str, dict] = field(default_factory=dict)


def included_parts(manifest: dict) -> tuple[str, ...]:
    """The optional parts (`OPTIONAL_PARTS`) a converted checkpoint was written with."""
    return tuple(p for p in manifest["options"]["include"] if p in OPTIONAL_PARTS)


def restore(
    directory: str | Path,
    *,
    mesh=None,
    rules=None,
    widen_bf16: bool = False,
    engram_on_host: bool = True,
    parts: Iterable[str] | None = None,
    engram: bool = True,
) -> Restored:
    """Restore a converted checkpoint. With `mesh`, `params` become jax Arrays sharded by
    `ced_jax.sharding.param_shardings(specs, mesh, rules)` (default rules EP_TP_RULES), whatever mesh
    it was written on; the separate Engram item stays in host memory unless `engram_on_host=False`,
    and the optional parts (`dspark`, `vision`) always do. `parts`: the optional parts to read
    (default: every one written; one not written is a CheckpointError naming the --include that
    writes it). engram=False: the separate Engram item is not read (`engram` None; for a model that
    memory-maps the raw table files instead, `ced_jax.engram_store`). Leaves are checked against the
    config's specs before any data is read."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    manifest = read_manifest(directory)
    opts = manifest["options"]
    try:
        cfg = ModelConfig.from_pretrained(directory)
    except ConfigError as e:
        raise CheckpointError(f"{directory / 'config.json'}: {e}") from None
    written = included_parts(manifest)
    wanted_parts = written if parts is None else tuple(parts)
    for part in wanted_parts:
        if part not in OPTIONAL_PARTS:
            raise ValueError(f"parts: unknown part {part!r}; known: {list(OPTIONAL_PARTS)}")
        if part not in written:
            raise CheckpointError(
                f"{directory}: converted without its {part!r} part (include={opts['include']}); "
                f"convert again with --include text,{part}"
            )
    targets = target_specs(
        cfg, weights_dtype=opts["weights_dtype"], engram=opts["engram"], include=opts["include"]
    )
    by_item: dict[str, dict[str, ParamSpec]] = {}
    for path, spec in targets.items():
        item = item_of(path, opts["engram"])
        if item in OPTIONAL_PARTS and item not in wanted_parts:
            continue
        if item == ENGRAM_ITEM and not engram:
            continue
        by_item.setdefault(item, {})[path] = spec

    loaded: dict[str, dict] = {}
    verified = _VerifiedZarr3Items()
    logging.getLogger("absl").addFilter(verified)
    try:
        for item, specs in by_item.items():
            path = directory / item
            if not path.is_dir():
                raise CheckpointError(f"{path}: Orbax item missing (named by {MANIFEST_NAME})")
            verified.check(path, specs)
            loaded[item] = _restore_item(ocp, path, item, specs, mesh, rules, engram_on_host, widen_bf16)
    finally:
        logging.getLogger("absl").removeFilter(verified)
    parts = {item: tree for item, tree in loaded.items() if item in OPTIONAL_PARTS}
    return Restored(cfg, manifest, loaded.get(PARAMS_ITEM, {}), loaded.get(ENGRAM_ITEM), parts)


def _on_device(dtype, widen_bf16: bool) -> np.dtype:
    """The dtype a leaf is restored as on a mesh: bf16 widened to f32 (exact) when asked."""
    return np.dtype(np.float32) if widen_bf16 and np.dtype(dtype) == np.dtype(BF16) else np.dtype(dtype)


def _restore_item(
    ocp,
    path: Path,
    item: str,
    specs: dict[str, ParamSpec],
    mesh,
    rules,
    engram_on_host: bool,
    widen_bf16: bool,
):
    """One Orbax item, its leaves checked against `specs` before any data is read."""
    import jax

    meta = flatten(ocp.v1.metadata(path).metadata)
    for leaf, spec in specs.items():
        m = meta.get(leaf)
        if m is None:
            raise CheckpointError(f"{path}: leaf {leaf} missing")
        if tuple(m.shape) != tuple(spec.shape) or np.dtype(m.dtype) != np.dtype(spec.dtype):
            raise CheckpointError(
                f"{path}: leaf {leaf} is {np.dtype(m.dtype)} {list(m.shape)}, config.json needs "
                f"{np.dtype(spec.dtype)} {list(spec.shape)}"
            )
    extra = sorted(set(meta) - set(specs))
    if extra:
        raise CheckpointError(f"{path}: leaves the config does not describe: {extra[:5]}")
    on_host = item in OPTIONAL_PARTS or (item == ENGRAM_ITEM and engram_on_host)
    on_device = mesh is not None and not on_host
    if on_device:
        from ced_jax.sharding import EP_TP_RULES, param_shardings

        shardings = flatten(param_shardings(nest(specs), mesh, EP_TP_RULES if rules is None else rules))
        abstract = nest(
            {
                leaf: jax.ShapeDtypeStruct(
                    spec.shape, _on_device(spec.dtype, widen_bf16), sharding=shardings[leaf]
                )
                for leaf, spec in specs.items()
            }
        )
        # Orbax reads every leaf at once unless told otherwise: the whole item in host buffers before
        # they reach the devices. Bounded to one leaf (the largest) plus READ_SLACK_BYTES in flight.
        largest = max(
            (math.prod(s.shape) * _on_device(s.dtype, widen_bf16).itemsize for s in specs.values()), default=0
        )
        ctx = ocp.v1.Context()
        ctx.memory.read_concurrent_bytes = largest + READ_SLACK_BYTES
        with ctx:
            return ocp.v1.load(path, abstract)
    return ocp.v1.load(path)  # saved as numpy: comes back as numpy, in host memory


class _VerifiedZarr3Items(logging.Filter):
    """Orbax (0.12.8, and its main branch as of this writing) warns "TensorStore data files not found
    in checkpoint path ... This may be a sign of a malformed checkpoint" on every restore of a
    checkpoint stored as plain zarr3, its own default format: its check
    (`orbax_layout.has_tensorstore_data_files`) looks for OCDBT's `manifest.ocdbt` or zarr v2's
    `.zarray` files, never zarr3's `zarr.json`. `check` verifies what that check means to verify (each
    leaf has its array data on disk: a `zarr.json` per leaf, or the OCDBT manifest) and raises if not;
    only for items that passed is that one warning dropped, so a really malformed item still fails."""

    WARNING = "TensorStore data files not found in checkpoint path"

    def __init__(self) -> None:
        super().__init__()
        self.paths: set[str] = set()

    def check(self, path: Path, leaves: Iterable[str]) -> None:
        trees = [d for d in path.iterdir() if (d / "_METADATA").is_file()]
        if len(trees) != 1:
            raise CheckpointError(f"{path}: not an Orbax item (no single directory with _METADATA)")
        tree = trees[0]
        if not (tree / "manifest.ocdbt").is_file():
            for leaf in leaves:
                if not (tree / leaf / "zarr.json").is_file():
                    raise CheckpointError(
                        f"{path}: leaf {leaf} has no data ({tree / leaf / 'zarr.json'} missing)"
                    )
        self.paths.add(str(path))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.getMessage().startswith(self.WARNING) and record.args and str(record.args[0]) in self.paths
        )


def _check_model_checkpoint(directory: str | Path, parts: Iterable[str]) -> tuple[str, ...]:
    """What the ced_jax model needs of a converted checkpoint (native formats, Engram tables when
    its layers use them, only model-parameter parts), checked before anything is read -> parts."""
    manifest = read_manifest(directory)
    opts = manifest["options"]
    if opts["weights_dtype"] != "native":
        raise CheckpointError(
            f"{directory}: converted with --weights-dtype {opts['weights_dtype']}; the ced_jax model runs "
            "the native FP8/FP4 formats; convert again with --weights-dtype native"
        )
    if opts["engram"] == "skip":
        cfg = ModelConfig.from_pretrained(directory)
        if cfg.engram_layer_ids:
            raise CheckpointError(
                f"{directory}: converted with --engram skip, but the model's layers "
                f"{list(cfg.engram_layer_ids)} need their Engram tables; convert with --engram separate"
            )
    parts = tuple(parts)
    unsupported = [p for p in parts if p != "dspark"]
    if unsupported:
        raise ValueError(f"parts: {unsupported} are not model parameters (only 'dspark' is)")
    return parts


def load_flat(
    directory: str | Path, *, parts: Iterable[str] = (), engram: bool = True
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, {dotted path: numpy array}) of a native converted checkpoint, all in host memory:
    the same dict `hf_loader.load_hf_checkpoint` returns for the source (with `parts=("dspark",)`
    also the DSpark stages' `mtp.*` leaves, as `include=("text", "dspark")` gives them). engram=False:
    without the separate Engram item's tables (see `restore`)."""
    parts = _check_model_checkpoint(directory, parts)
    r = restore(directory, parts=parts, engram=engram)
    flat = flatten(r.params)
    if r.engram is not None:
        flat.update(flatten(r.engram))
    for tree in r.parts.values():
        flat.update(flatten(tree))
    return r.cfg, {k: np.asarray(v) for k, v in flat.items()}


def load_onto_mesh(
    directory: str | Path,
    mesh,
    rules,
    *,
    parts: Iterable[str] = (),
    engram: bool = True,
    widen_bf16: bool = False,
) -> tuple[ModelConfig, dict[str, Any]]:
    """`load_flat` for a mesh: (config, {dotted path: array}) where the leaves of the `params` item
    are jax Arrays restored by Orbax straight into their shardings
    (`ced_jax.sharding.param_shardings(specs, mesh, rules)`: each process reads only the chunks its
    devices hold, no whole-model host copy), and the separate Engram item's tables (unless
    `engram=False`) and the DSpark leaves (`parts=("dspark",)`) are numpy in host memory, as
    `load_flat` gives them. An `--engram inline` checkpoint has its tables in `params`, so they come
    back on the mesh too. `widen_bf16`: bf16 leaves restored as f32 (exact; what `ced_jax.api` runs on
    CPU), with no bf16 copy on the devices."""
    parts = _check_model_checkpoint(directory, parts)
    r = restore(directory, mesh=mesh, rules=rules, widen_bf16=widen_bf16, parts=parts, engram=engram)
    flat: dict[str, Any] = dict(flatten(r.params))
    if r.engram is not None:
        flat.update({k: np.asarray(v) for k, v in flatten(r.engram).items()})
    for tree in r.parts.values():
        flat.update({k: np.asarray(v) for k, v in flatten(tree).items()})
    return r.cfg, flat
