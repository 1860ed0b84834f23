"""Synthetic random-weight checkpoints in the released layout (sharded safetensors + index + config),
for the conversion tests and benchmarks.

The tensors are `ced_jax.testing.random_weights` draws (the `mid` generation scheme of
bench/configs/mid/README.md, so that `bench/make_mid_weights.py` yields the published content hash),
in the stored dtypes. Shards follow the release: embed + the first half of the layers, then the
other half + norm + head (+ mtp.*, vision), and the Engram tables alone in the last shard. Each
shard is generated and written on its own (safetensors.numpy.save_file, metadata {"format": "pt"}),
so memory is bounded by one shard.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from safetensors.numpy import save_file

from ced_jax.checkpoint.hf_loader import INDEX_NAME
from ced_jax.checkpoint.mapping import FILE_DTYPES, hf_inventory
from ced_jax.config import ModelConfig
from ced_jax.testing.random_weights import iter_hf_tensors


# ---------------------------------------------------------------------- checkpoint files
def shard_file_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def default_shard_plan(cfg: ModelConfig) -> list[list[str]]:
    """Release-like layout: [embed + first half of the layers], [second half + norm + head + mtp.* +
    vision], [Engram tables] (the last only when the model has Engram layers)."""
    inventory = hf_inventory(cfg)
    half = (cfg.num_layers + 1) // 2
    first: list[str] = []
    second: list[str] = []
    tables: list[str] = []
    for name, spec in inventory.items():
        if spec.group == "engram_table":
            tables.append(name)
        elif name == "embed.weight" or (name.startswith("layers.") and int(name.split(".")[1]) < half):
            first.append(name)
        else:
            second.append(name)
    return [s for s in (first, second, tables) if s]


def write_synthetic_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    seed: int,
    shard_plan: Sequence[Sequence[str]] | None = None,
    config_path: str | Path | None = None,
    tokenizer_files: Iterable[str | Path] = (),
) -> dict[str, object]:
    """Write shards + index + config.json (+ tokenizer files) for `cfg` into `out_dir`.

    `shard_plan`: the tensor names of each shard, together a partition of the inventory (default
    `default_shard_plan`). `config_path`: a config.json to copy byte for byte (default: written
    from `cfg.to_hf_dict()`). Returns {"files": [...], "total_size": int, "tensors": int}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inventory = hf_inventory(cfg)
    plan = [list(s) for s in (shard_plan if shard_plan is not None else default_shard_plan(cfg))]
    flat = [n for s in plan for n in s]
    if sorted(flat) != sorted(inventory):
        extra = sorted(set(flat) - set(inventory))
        missing = sorted(set(inventory) - set(flat))
        dup = len(flat) - len(set(flat))
        raise ValueError(
            f"shard_plan must partition the inventory: unknown {extra[:5]}, "
            f"missing {missing[:5]}, {dup} duplicate(s)"
        )
    files = shard_file_names(len(plan))
    weight_map: dict[str, str] = {}
    total = 0
    for file, names in zip(files, plan, strict=True):
        tensors = {}
        for name, arr in iter_hf_tensors(cfg, seed, names):
            # Same bytes, viewed as the dtype that makes save_file write the right code.
            tensors[name] = arr.view(FILE_DTYPES[inventory[name].dtype])
            total += arr.nbytes
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if config_path is not None:
        shutil.copyfile(config_path, out / "config.json")
    else:
        (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    for f in tokenizer_files:
        shutil.copyfile(f, out / Path(f).name)
    return {"files": files, "total_size": total, "tensors": len(weight_map)}
