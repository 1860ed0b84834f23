"""How the quantised weights are kept on the device: as released, or dequantised once at load.

The released checkpoint stores the dense linears in FP8 (e4m3 with ue8m0 block scales) and the
routed experts in packed FP4 (e2m1 with ue8m0 scales per 32). Dequantising is exact (a code times a
power of two), so the layout changes where the dequantisation happens, never a value:
- "stored": the released formats; every program dequantises each weight it reads at every step.
  What the Pallas kernels read, and the only layout on a mesh (the sharding rules name the stored
  leaves).
- "f32-dense": the backbone's FP8 linears (attention, indexer queries, shared experts, Engram
  projections) as f32 `{'weight': [N, K]}` without their scales; routed experts stored. The f32
  copy costs 4 bytes per weight (a few per cent of a model whose bytes are in its experts).
- "f32": "f32-dense" and the routed experts as f32 `{'weight': [E, N, K]}` too (8x their packed
  bytes).

On XLA:CPU the per-step dequantisation of a small model costs more than its matmuls: a `tiny`
decode step spent about 8.7 of 16 ms in 62 FP8 dequantisations and 40 FP4 expert gathers
(BENCHMARKS.md), so `default_weight_layout` picks "f32" there when it fits. On accelerators the
stored bytes are what a decode step reads, so it keeps them.

The Engram tables (row-gathered) and the DSpark stages (`ced_jax.training.dspark_train` starts from their
stored pairs) stay stored in every layout. The layers read weights through
`ced_jax.quant.linear_weight` / `expert_weight`, which dequantise a stored pair and pass an f32 one
through: the same f32 values either way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ced_jax.options import Impl
from pallas_kernels.formats import dequant_fp4_weight, dequant_fp8_weight

WEIGHT_LAYOUTS = ("stored", "f32-dense", "f32")
# "f32" is the CPU default only while the routed experts' f32 copy stays below this (the `tiny`
# preset: 25 MB; the bench's `mid` config: 6.4 GB, over any sensible host budget).
F32_EXPERTS_MAX_BYTES = 1 << 30


def check_weight_layout(layout: str) -> str:
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout: expected one of {list(WEIGHT_LAYOUTS)}, got {layout!r}")
    return layout


def routed_expert_f32_bytes(cfg) -> int:
    """Bytes of every layer's routed experts (w1, w3, w2) dequantised to f32."""
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    return 4 * per_expert * cfg.n_routed_experts * cfg.num_layers


def default_weight_layout(cfg, *, backend: str, mesh, impl: str | Impl) -> str:
    """The layout `ced_jax.load` uses when none is given: "f32" on a single XLA:CPU device when the
    routed experts' f32 copy is small and no Pallas kernel reads them, else "stored".

    Not "f32-dense" on CPU: on the bench's `mid` config (experts too large for "f32") it measured
    no faster than "stored" at batch 1 and 8 and pushed the peak RSS over issue 10's 3 GiB bound
    (BENCHMARKS.md): there the step's time is in the FP4 experts, and the dense dequantisations run
    beside them on the other core."""
    if backend != "cpu" or mesh is not None:
        return "stored"
    if not Impl.parse(impl).reads_packed_experts and routed_expert_f32_bytes(cfg) <= F32_EXPERTS_MAX_BYTES:
        return "f32"
    return "stored"


def check_compatible(layout: str, *, mesh, impl: str | Impl) -> None:
    """A layout the model can run: a mesh's sharding rules and the Pallas grouped matmul read the
    stored formats."""
    check_weight_layout(layout)
    if mesh is not None and layout != "stored":
        raise ValueError(f"weight_layout={layout!r}: a mesh places the stored formats; use 'stored'")
    if Impl.parse(impl).reads_packed_experts and layout == "f32":
        kind = Impl.parse(impl).kind
        raise ValueError(
            f"weight_layout='f32': impl='{kind}' runs the FP4 expert kernel on the packed "
            "experts; use 'f32-dense' or 'stored'"
        )


def _is_fp8_pair(node) -> bool:
    return (
        isinstance(node, dict)
        and set(node) == {"weight", "scale"}
        and node["weight"].dtype == jnp.float8_e4m3fn
        and node["weight"].ndim == 2
    )


def _is_fp4_experts(node) -> bool:
    return (
        isinstance(node, dict)
        and set(node) == {"weight", "scale"}
        and node["weight"].dtype == jnp.uint8
        and node["weight"].ndim == 3
    )


_dequant_fp8 = jax.jit(dequant_fp8_weight, static_argnames=("block",))
_dequant_fp4 = jax.jit(dequant_fp4_weight)


def apply_weight_layout(params: dict, layout: str, *, block: int) -> dict:
    """The parameter tree in `layout` (from "stored"; a new tree, the stored leaves released as each
    is replaced). The Engram tables (`engram.embed`, row-gathered) stay stored in every layout.
    Dequantisation runs through `pallas_kernels.formats`, jitted, on the device that holds the
    weight: the very function the programs would run, so the values are theirs bit for bit."""
    check_weight_layout(layout)
    if layout == "stored":
        return params

    def walk(node, path: tuple[str, ...]):
        if not isinstance(node, dict):
            return node
        if path and path[-1] == "embed" and "engram" in path:
            return node
        if _is_fp8_pair(node):
            return {"weight": _dequant_fp8(node["weight"], node["scale"], block=block)}
        if layout == "f32" and _is_fp4_experts(node) and "experts" in path:
            # One expert at a time keeps the transient to one expert's f32 weights.
            weight = jnp.stack(
                [_dequant_fp4(node["weight"][e], node["scale"][e]) for e in range(node["weight"].shape[0])]
            )
            return {"weight": weight}
        return {k: walk(v, (*path, k)) for k, v in node.items()}

    return walk(params, ())


def tree_bytes(params: dict) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
