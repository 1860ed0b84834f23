"""Placing a checkpoint's flat arrays ({dotted name: array}) as the model's nested parameters on one
device or over a mesh (`ced_jax.trees.nest`): the shardings each parameter gets from its spec's
logical axes, the DSpark stages' tree and the Engram tables' placement."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ced_jax import sharding
from ced_jax.checkpoint.mapping import DSPARK_PREFIX, is_engram_table, our_param_specs
from ced_jax.config import ModelConfig
from ced_jax.engram_store import EngramStore, table_leaves
from ced_jax.model import flatten_specs, param_specs
from ced_jax.trees import nest


def to_device(
    flat: dict[str, np.ndarray], bf16_as_f32: bool, shardings: dict[str, Any] | None = None
) -> dict:
    """Flat arrays -> nested device arrays. bf16 is widened to f32 (exact) where XLA:CPU would
    otherwise run pathologically slow bf16 GEMVs. With `shardings` (flat name -> NamedSharding) each
    device receives only its own block, also across processes."""

    def place(name: str, arr):
        if bf16_as_f32 and arr.dtype == ml_dtypes.bfloat16:
            arr = arr.astype(np.float32)
        return jnp.asarray(arr) if shardings is None else sharding.put_global(arr, shardings[name])

    return nest(flat, place)


def flat_param_shardings(cfg: ModelConfig, names, mesh, rules) -> dict[str, Any]:
    """flat name -> NamedSharding from the parameter specs' logical axes (sharding.param_shardings)."""
    specs = param_specs(cfg)
    unknown = sorted(set(names) - set(flatten_specs(specs)))
    if unknown:
        raise ValueError(f"parameters without a spec (cannot be placed on the mesh): {unknown[:5]}")
    nested = sharding.param_shardings(specs, mesh, rules)
    out = {}
    for name in names:
        node = nested
        for part in name.split("."):
            node = node[part]
        out[name] = node
    return out


def mesh_targets(cfg: ModelConfig, mesh, rules) -> dict[str, Any]:
    """The parameters `load` reads straight onto the mesh (flat name -> NamedSharding): every backbone
    parameter but the Engram tables, which the model keeps in host memory or places itself."""
    names = [n for n in flatten_specs(param_specs(cfg)) if not is_engram_table(n)]
    return flat_param_shardings(cfg, names, mesh, sharding.get_rules(rules))


def dspark_to_device(cfg: ModelConfig, flat: dict[str, np.ndarray], mesh) -> dict:
    """The DSpark stages' flat `mtp.*` arrays -> the nested tree under params["mtp"], as
    `ced_jax.checkpoint.dspark.load_dspark_params` gives it: storage dtypes kept (no bf16 widening: the stages
    are small and the draft code casts where it computes in f32), checked against the config's
    inventory. On a mesh every device gets the whole (small) tree: replicated."""
    if cfg.num_nextn_predict_layers <= 0:
        raise ValueError(
            f"DSpark parameters given (e.g. {sorted(flat)[0]}) but the config's num_nextn_predict_layers is 0"
        )
    specs = our_param_specs(cfg, ("dspark",))
    missing = sorted(set(specs) - set(flat))
    extra = sorted(set(flat) - set(specs))
    if missing or extra:
        raise ValueError(
            f"DSpark parameters: missing {missing[:5]}, not in the config's inventory {extra[:5]}"
        )
    for name, arr in flat.items():
        shape, dtype = specs[name]
        if tuple(arr.shape) != shape or np.dtype(arr.dtype) != dtype:
            raise ValueError(
                f"DSpark parameter {name}: {arr.dtype} {list(arr.shape)}, expected {dtype} {list(shape)}"
            )
    target = None if mesh is None else sharding.replicated(mesh)
    stages = {name[len(DSPARK_PREFIX) :]: arr for name, arr in flat.items()}
    return nest(stages, lambda _, a: jnp.asarray(a) if target is None else sharding.put_global(a, target))


def place_engram(
    cfg: ModelConfig, backbone: dict[str, np.ndarray], placement: str, store: EngramStore | None
) -> EngramStore | None:
    """Move the Engram tables between `backbone` (flat params, changed in place) and a host store
    as `placement` says; returns the store (None on device or without Engram layers)."""
    if not cfg.engram_layer_ids:
        return None
    if placement == "host":
        if store is None:
            return EngramStore.pop_from_flat(cfg, backbone)
        for pair in table_leaves(cfg):
            for leaf in pair:
                backbone.pop(leaf, None)
        return store
    if store is not None:
        for (w, s), (tw, ts) in zip(table_leaves(cfg), store.tables, strict=True):
            backbone[w], backbone[s] = np.asarray(tw), np.asarray(ts)
    return None
