"""Loading the DSpark draft stages (`mtp.*`) of a released-layout checkpoint (spec 7.3); their forward
pass is `ced_jax.model.dspark`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ced_jax.checkpoint.hf_loader import CheckpointError, Shard, read_index
from ced_jax.checkpoint.mapping import hf_inventory, our_target
from ced_jax.config import ModelConfig
from ced_jax.trees import nest
from pallas_kernels.formats import np_dequant_fp8_weight


def load_dspark_params(directory: str | Path, cfg: ModelConfig) -> dict:
    """Read only the `mtp.*` tensors of a released-layout HF checkpoint directory.

    Returns the nested tree {'mtp': {'0': {...block..., 'main_proj', 'main_norm'}, ..., 'S-1': {...,
    'norm', 'markov_head', 'confidence_head'}}} as jax arrays in our storage dtypes (FP8 weights with
    their ue8m0 scale bytes, FP4 experts packed and stacked [E, ...], `attn.wo_a` dequantised to bf16). Dtypes
    and shapes are checked against `mapping.hf_inventory(cfg)`; a missing or wrong tensor raises
    `CheckpointError` naming it."""
    if cfg.num_nextn_predict_layers <= 0:
        raise ValueError("config: num_nextn_predict_layers is 0, the checkpoint has no DSpark stages")
    directory = Path(directory)
    weight_map = read_index(directory)
    wanted = {n: s for n, s in hf_inventory(cfg).items() if s.group == "dspark"}
    missing = sorted(n for n in wanted if n not in weight_map)
    if missing:
        raise CheckpointError(f"{directory}: missing DSpark tensor(s): {missing[:10]}")
    n_experts = cfg.dspark_n_routed_experts
    flat: dict[str, np.ndarray] = {}
    wo_a: dict[str, dict[str, np.ndarray]] = {}
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_map[name], []).append(name)
    for file, names in sorted(by_file.items()):
        with Shard(directory, file) as shard:
            for name in names:
                spec = wanted[name]
                dtype, shape = shard.dtype_shape(name)
                if (dtype, shape) != (spec.dtype, spec.shape):
                    raise CheckpointError(
                        f"{shard.path}: tensor '{name}': expected {spec.dtype} {list(spec.shape)}, "
                        f"got {dtype} {list(shape)}"
                    )
                arr = shard.read(name, spec.dtype, spec.shape)
                target = our_target(name)
                if target.kind == "copy":
                    flat[target.path] = arr
                elif target.kind == "stack":
                    buf = flat.get(target.path)
                    if buf is None:
                        buf = flat[target.path] = np.empty((n_experts, *arr.shape), arr.dtype)
                    buf[target.expert] = arr
                else:
                    pending = wo_a.setdefault(target.path, {})
                    pending["weight" if target.kind == "wo_a" else "scale"] = arr
    for path, pair in wo_a.items():
        # As convert.py does for the backbone's wo_a: exact (4 significant bits times a power of two).
        w = np_dequant_fp8_weight(pair["weight"], pair["scale"], cfg.weight_block_size)
        flat[path] = w.astype(ml_dtypes.bfloat16)
    return nest(flat, lambda _, a: jnp.asarray(a))
