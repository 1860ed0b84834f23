"""The one place where logical axes meet mesh axes.

Model code names logical axes only (`ParamSpec.axes` in ced_jax.model, cache axes below). A rules
table maps each logical axis to a mesh axis (or None = replicated); every PartitionSpec in the
project is derived here, for the model, the converter and the server alike.

Mesh axes: `data` (independent sequences), `expert` (routed experts: expert parallelism),
`tensor` (attention heads, vocabulary, expert hidden width: tensor parallelism).

Logical axes:
- vocab        embedding / head rows
- embed        model width D (never sharded by the shipped rules: activations stay replicated
               over `tensor` between sublayers, as the reference's all-reduce layout)
- q_heads      query heads x head_dim (wq_b rows, attn_sink)
- o_groups     output-projection groups (wo_a rows, wo_b columns)
- index_heads  indexer heads
- experts      routed experts
- expert_mlp   routed-expert hidden width (F)
- mlp          shared-expert hidden width
- engram_rows  Engram hash-table rows
- batch        sequences (cache and activations)
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "tensor")
LOGICAL_AXES = (
    "vocab",
    "embed",
    "q_heads",
    "o_groups",
    "index_heads",
    "experts",
    "expert_mlp",
    "mlp",
    "engram_rows",
    "batch",
)

Rules = Mapping[str, str | None]

# Expert parallelism for the routed experts, tensor parallelism for attention heads and the
# vocabulary, data parallelism over sequences.
EP_TP_RULES: Rules = {
    "vocab": "tensor",
    "embed": None,
    "q_heads": "tensor",
    "o_groups": "tensor",
    "index_heads": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "mlp": "tensor",
    "engram_rows": None,
    "batch": "data",
}
# Pure tensor parallelism: experts split along their hidden width, everything else as above.
TP_RULES: Rules = {**EP_TP_RULES, "experts": None}
# Everything replicated (single device, or a reference run on a mesh).
REPLICATED_RULES: Rules = dict.fromkeys(LOGICAL_AXES)

RULES = {"ep_tp": EP_TP_RULES, "tp": TP_RULES, "replicated": REPLICATED_RULES}


def check_rules(rules: Rules) -> None:
    unknown = sorted(set(rules) - set(LOGICAL_AXES))
    if unknown:
        raise ValueError(f"sharding rules name unknown logical axes {unknown}")
    bad = sorted({v for v in rules.values() if v is not None} - set(MESH_AXES))
    if bad:
        raise ValueError(f"sharding rules name unknown mesh axes {bad}; known: {MESH_AXES}")


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,expert=4,tensor=2' -> {'data': 1, 'expert': 4, 'tensor': 2} (missing axes are 1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes:
            raise ValueError(f"--mesh: unknown axis {name!r}; known: {list(MESH_AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh: axis {name} needs an integer size, got {value!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"--mesh: axis {name} must be >= 1, got {sizes[name]}")
    return sizes


def make_mesh(sizes: Mapping[str, int], devices=None) -> Mesh:
    """A (data, expert, tensor) mesh with Auto axes (GSPMD propagation inside jit)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(int(sizes.get(a, 1)) for a in MESH_AXES)
    need = int(np.prod(shape))
    if need != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape, strict=True))} needs {need} devices, "
            f"{len(devices)} are available"
        )
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(
    axes: tuple[str | None, ...], rules: Rules, shape: tuple[int, ...] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """Logical axes -> PartitionSpec. A mesh axis is used at most once per array; a dimension that
    the mesh axis does not divide stays replicated (checked, never silently wrong)."""
    used: set[str] = set()
    out: list[str | None] = []
    for i, axis in enumerate(axes):
        mesh_axis = None if axis is None else rules.get(axis)
        if mesh_axis is not None and (
            mesh_axis in used
            or (mesh is not None and shape is not None and shape[i] % mesh.shape[mesh_axis] != 0)
        ):
            mesh_axis = None
        if mesh_axis is not None:
            used.add(mesh_axis)
        out.append(mesh_axis)
    return PartitionSpec(*out)


def param_shardings(specs: dict, mesh: Mesh, rules: Rules) -> dict:
    """Nested ParamSpec tree (ced_jax.model.param_specs) -> matching tree of NamedShardings."""
    check_rules(rules)

    def go(node):
        if isinstance(node, dict):
            return {k: go(v) for k, v in node.items()}
        return NamedSharding(mesh, logical_to_spec(node.axes, rules, node.shape, mesh))

    return go(specs)


def cache_shardings(cache: dict, mesh: Mesh, rules: Rules) -> dict:
    """Every cache array is [batch, ...]: sharded over sequences only."""
    return jax.tree.map(
        lambda a: NamedSharding(
            mesh, logical_to_spec(("batch",) + (None,) * (a.ndim - 1), rules, a.shape, mesh)
        ),
        cache,
    )
