"""The vision tower's weights: the `vision` group of the released tensors (spec 5.2), under their
released names (`vision.patch_embed.proj.weight`, `vision.blocks.N...`, `aligner.w1...`,
`image_start`, ...), stored bytes unchanged (BF16 stays `ml_dtypes.bfloat16`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ced_jax.checkpoint import converted
from ced_jax.checkpoint.converted import is_converted_checkpoint
from ced_jax.checkpoint.hf_loader import CheckpointError, Shard, read_index
from ced_jax.checkpoint.mapping import hf_inventory
from ced_jax.config import ModelConfig
from ced_jax.trees import flatten


def vision_inventory(cfg: ModelConfig) -> dict:
    """Released name -> TensorSpec (with its random init) of every vision-group tensor of `cfg` (empty
    without a tower; the shapes are `ced_jax.vision.params.vision_param_specs`)."""
    return {n: s for n, s in hf_inventory(cfg).items() if s.group == "vision"}


def load_vision_params(
    directory: str | Path, cfg: ModelConfig, *, required: bool = True
) -> dict[str, np.ndarray] | None:
    """{released name: array} of the vision tower, aligner and image delimiters, from a released HF
    directory (sharded safetensors + index) or a `convert_weights` output with a `vision` item.
    None when the config has no vision tower, or (with required=False) when a converted checkpoint
    was written without its vision item (a text-only deployment). Shapes and dtypes are checked
    against the config; anything missing is a CheckpointError naming it."""
    if cfg.vision is None:
        return None
    directory = Path(directory)
    specs = vision_inventory(cfg)
    if is_converted_checkpoint(directory):
        return _from_converted(directory, cfg, specs, required)
    weight_map = read_index(directory)
    missing = [n for n in specs if n not in weight_map]
    if missing:
        raise CheckpointError(
            f"{directory}: {len(missing)} vision tensor(s) missing from the index, e.g. "
            + ", ".join(f"'{n}'" for n in missing[:5])
        )
    out: dict[str, np.ndarray] = {}
    by_file: dict[str, list[str]] = {}
    for name in specs:
        by_file.setdefault(weight_map[name], []).append(name)
    for file, names in by_file.items():
        with Shard(directory, file) as shard:
            for name in names:
                spec = specs[name]
                dtype, shape = shard.dtype_shape(name)
                if dtype != spec.dtype or tuple(shape) != tuple(spec.shape):
                    raise CheckpointError(
                        f"{shard.path}: '{name}' is {dtype} {list(shape)}, "
                        f"expected {spec.dtype} {list(spec.shape)} for this config"
                    )
                out[name] = shard.read(name, dtype, tuple(shape))
    return out


def _from_converted(
    directory: Path, cfg: ModelConfig, specs: dict, required: bool
) -> dict[str, np.ndarray] | None:
    manifest = converted.read_manifest(directory)
    if "vision" not in manifest["options"].get("include", []):
        if not required:
            return None
        raise CheckpointError(
            f"{directory}: converted without the vision tower; convert again with --include text,vision"
        )
    import orbax.checkpoint as ocp

    # Only the vision item is read (the text weights may be hundreds of GB).
    tree = converted._restore_item(
        ocp, directory / "vision", "vision", converted.part_specs(cfg, "vision"), None, None, True, False
    )
    flat = flatten(tree)
    out = {name: np.asarray(flat[name]) for name in specs if name in flat}
    missing = [n for n in specs if n not in out]
    if missing:
        raise CheckpointError(f"{directory}: vision item lacks {', '.join(missing[:5])}")
    return out
