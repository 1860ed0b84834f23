"""One tensor group's leaves, assembled as its tensors are read: stored bytes go straight into the leaf
(an expert into its slot of the stacked array), paired weights and scales are dequantised."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ced_jax.checkpoint.converted import WeightsDtype
from ced_jax.checkpoint.mapping import STORAGE_DTYPES, our_target
from conversion.options import ConversionError
from conversion.plan import Group, Plan
from pallas_kernels.formats import np_dequant_fp4_weight, np_dequant_fp8_weight


def _dequantize_rows_into(weight: np.ndarray, scale: np.ndarray, block: int, out: np.ndarray) -> None:
    """FP8 rows with one ue8m0 per `block` columns (Engram tables) -> bf16 `out`, a slab at a time
    so the f32 temporary stays small."""
    rows, cols = weight.shape
    step = max(1, (64 << 20) // (4 * cols))
    for r in range(0, rows, step):
        f32 = np_dequant_fp8_weight(weight[r : r + step], scale[r : r + step], block, block_rows=1)
        out[r : r + step] = f32.astype(ml_dtypes.bfloat16)


class GroupBuilder:
    """Collects one group's tensors into its leaves. `destination` says where a tensor's stored
    bytes go (straight into the leaf when no conversion is needed), `filled` finishes it."""

    def __init__(self, group: Group, plan: Plan, weights_dtype: WeightsDtype) -> None:
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
