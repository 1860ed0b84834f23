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
- expert_mlp   routed-expert output rows: the hidden width F of w1/w3, the width D of w2 (both
               split without partial sums, see ced_jax.model.layers.moe)
- mlp          shared-expert hidden width
- engram_rows  Engram hash-table rows
- batch        sequences (cache and activations)
- pages        the KV page pool (`ced_jax.cache.paged_cache_axes`): None keeps every page on every
               device (a prefix page may serve sequences on any device); a mesh axis (only the same
               as `batch`'s) gives each device the pages of its own sequences: data-parallel attention

A rule is a mesh axis, a tuple of mesh axes (the dimension split over their product, in that order),
or None.

Data-parallel attention (`dp_ep`). When `pages` is split, `ced_jax.model.forward` runs each device's
sequences on that device alone (a shard_map over the batch's mesh axes): its rows, their slots' rings
and partial groups, and their pages, addressed through page tables translated to the device's block.
Only the routed experts are split otherwise (over `expert`), and the MoE exchanges tokens with the
devices holding their experts by all-to-all, as DeepSeek-style deployments do (DP attention + EP).

A rules table is a complete, explicit decision: `None` replicates a logical axis on purpose. A spec
is never quietly weaker than its rules: a dimension that its mesh axis does not divide, or two
dimensions of one array on the same mesh axis, raise `ShardingError` naming the array, the logical
axis, the mesh axis and the sizes (a layout that silently replicates wastes memory the user sized
the mesh for). Only a mesh axis of size 1 (or one the mesh lacks) is dropped: it splits nothing.

Code that needs the layout at trace time (the MoE's shard_map dispatch) receives it as an argument
(`make_layout(mesh, rules)`, passed down by `ced_jax.model.forward`) and derives its PartitionSpecs
through `logical_to_spec`, never writing one by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
    "pages",
)

Rules = Mapping[str, str | tuple[str, ...] | None]

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
    # The Engram tables are not split: at full size they belong in host memory, where their rows
    # are gathered per token (spec 5.5); conversion.plan accounts for both placements.
    "engram_rows": None,
    "batch": "data",
    "pages": None,
}
# Pure tensor parallelism: experts split along their hidden width, everything else as above.
TP_RULES: Rules = {**EP_TP_RULES, "experts": None}
# Everything replicated (single device, or a reference run on a mesh).
REPLICATED_RULES: Rules = dict.fromkeys(LOGICAL_AXES)

# Data-parallel attention + expert parallelism: every device runs attention for its own sequences
# (batch, slots and pages split over all mesh axes), the routed experts are split over `expert`, and
# every other parameter is replicated (attention has no tensor split to share).
DP_EP_RULES: Rules = {**REPLICATED_RULES, "experts": "expert", "batch": MESH_AXES, "pages": MESH_AXES}

RULES = {"ep_tp": EP_TP_RULES, "tp": TP_RULES, "replicated": REPLICATED_RULES, "dp_ep": DP_EP_RULES}
DEFAULT_RULES = "ep_tp"


def get_rules(rules: str | Rules) -> Rules:
    """A rules table by name ('ep_tp', 'tp', 'replicated', 'dp_ep') or as given, checked."""
    if isinstance(rules, str):
        if rules not in RULES:
            raise ValueError(f"unknown sharding rules {rules!r}; known: {sorted(RULES)}")
        rules = RULES[rules]
    check_rules(rules)
    return rules


class ShardingError(ValueError):
    """A rules table, mesh and array shape that cannot be laid out as the rules say."""


def check_rules(rules: Rules) -> None:
    """Every logical axis has an explicit rule (a mesh axis, or None: replicated on purpose)."""
    unknown = sorted(set(rules) - set(LOGICAL_AXES))
    if unknown:
        raise ShardingError(f"sharding rules name unknown logical axes {unknown}")
    missing = [a for a in LOGICAL_AXES if a not in rules]
    if missing:
        raise ShardingError(
            f"sharding rules give no rule for logical axes {missing}; map each to a mesh axis or to "
            "None (replicated)"
        )
    named = [a for v in rules.values() for a in _mesh_axes_of(v)]
    bad = sorted(set(named) - set(MESH_AXES))
    if bad:
        raise ShardingError(f"sharding rules name unknown mesh axes {bad}; known: {MESH_AXES}")
    for axis, value in rules.items():
        parts = _mesh_axes_of(value)
        if len(set(parts)) != len(parts):
            raise ShardingError(f"sharding rule {axis!r}: {value!r} names a mesh axis twice")
    if rules["pages"] is not None and _mesh_axes_of(rules["pages"]) != _mesh_axes_of(rules["batch"]):
        raise ShardingError(
            f"sharding rules split 'pages' over {rules['pages']!r} but 'batch' over {rules['batch']!r}: "
            "a device holds the pages of its own sequences, so both must name the same mesh axes"
        )


def _mesh_axes_of(value) -> tuple[str, ...]:
    """A rule's mesh axes: () for None, (axis,) for a name, the tuple as given."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,expert=4,tensor=2' -> {'data': 1, 'expert': 4, 'tensor': 2} (missing axes are 1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    given: set[str] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes:
            raise ValueError(f"--mesh: unknown axis {name!r}; known: {list(MESH_AXES)}")
        if name in given:  # which size was meant is unknowable
            raise ValueError(f"--mesh: axis {name} is given twice")
        given.add(name)
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


MeshLike = Mesh | jax.sharding.AbstractMesh | Mapping[str, int]


def mesh_sizes(mesh: MeshLike) -> dict[str, int]:
    """{axis name: size} of a Mesh, an AbstractMesh or a plain mapping (the planner's meshes)."""
    return dict(mesh.shape) if hasattr(mesh, "axis_names") else dict(mesh)


def logical_to_spec(
    axes: tuple[str | None, ...],
    rules: Rules,
    shape: tuple[int, ...] | None = None,
    mesh: MeshLike | None = None,
    *,
    name: str = "array",
) -> PartitionSpec:
    """Logical axes -> PartitionSpec of the array `name` (named in errors).

    Raises ShardingError when two dimensions map to one mesh axis (a bug in the rules table,
    whatever the mesh) or when a mesh axis does not divide its dimension (given `shape` and `mesh`).
    A mesh axis the mesh lacks, or of size 1, is dropped so that specs stay comparable across
    meshes."""
    sizes = None if mesh is None else mesh_sizes(mesh)
    if shape is not None and len(shape) != len(axes):
        raise ShardingError(
            f"{name}: shape {tuple(shape)} has {len(shape)} dimensions, axes {axes} name {len(axes)}"
        )
    used: dict[str, str] = {}  # mesh axis -> the logical axis that took it
    out: list[str | None] = []
    for i, axis in enumerate(axes):
        if axis is not None and axis not in rules:
            raise ShardingError(f"{name}: logical axis {axis!r} has no rule (known: {sorted(rules)})")
        wanted = () if axis is None else _mesh_axes_of(rules[axis])
        for mesh_axis in wanted:
            if mesh_axis in used:
                raise ShardingError(
                    f"{name}: logical axes {used[mesh_axis]!r} and {axis!r} (of {axes}) both map to mesh "
                    f"axis {mesh_axis!r}; an array can be split over a mesh axis once: fix the rules table"
                )
            used[mesh_axis] = axis
        kept = tuple(a for a in wanted if (1 if sizes is None else sizes.get(a, 1)) > 1)
        if not kept:
            out.append(None)
            continue
        size = int(np.prod([sizes[a] for a in kept]))
        if shape is not None and shape[i] % size:
            over = kept[0] if len(kept) == 1 else kept
            raise ShardingError(
                f"{name} {tuple(shape)}: dimension {i} (logical axis {axis!r}, size {shape[i]}) does "
                f"not divide over mesh axis {over!r} of size {size}; use a mesh whose {over} "
                f"axis divides {shape[i]}, or rules with {axis!r}: None to replicate it"
            )
        out.append(kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def path_name(path) -> str:
    """A pytree key path as the dotted name the project uses for parameters ('layers.0.attn.wq_b')."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def param_shardings(specs: dict, mesh: Mesh, rules: Rules) -> dict:
    """Nested ParamSpec tree (ced_jax.model.param_specs) -> matching tree of NamedShardings."""
    check_rules(rules)

    def go(node, path: str):
        if isinstance(node, dict):
            return {k: go(v, f"{path}.{k}" if path else k) for k, v in node.items()}
        spec = logical_to_spec(node.axes, rules, node.shape, mesh, name=f"parameter {path}")
        return NamedSharding(mesh, spec)

    return go(specs, "")


def logical_shardings(axes, arrays, mesh: Mesh, rules: Rules):
    """Shardings for a tree of arrays (or ShapeDtypeStructs) given a same-shaped tree of logical-axis
    tuples (e.g. `ced_jax.cache.paged_cache_axes`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, ax, a: NamedSharding(
            mesh, logical_to_spec(ax, rules, a.shape, mesh, name=f"cache {path_name(path)}")
        ),
        axes,
        arrays,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh: MeshLike) -> tuple[int, ...]:
    """The per-device block of an array of `shape` laid out by `spec` on `mesh`."""
    sizes = mesh_sizes(mesh)
    out = []
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        div = int(np.prod([sizes[n] for n in names])) if names else 1
        out.append(dim // div)
    return tuple(out)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_global(arr, target: NamedSharding) -> jax.Array:
    """A host array (identical on every process) -> a global array laid out by `target`. A jax Array
    already laid out so (a parameter `load` read straight onto the mesh) is kept as is."""
    if isinstance(arr, jax.Array):
        return arr if arr.sharding.is_equivalent_to(target, arr.ndim) else jax.device_put(arr, target)
    arr = np.asarray(arr)
    return jax.make_array_from_callback(arr.shape, target, lambda index: arr[index])


# ------------------------------------------------------------------ the layout a program is traced under
@dataclass(frozen=True)
class Layout:
    """The mesh and rules a program is traced under (passed to the code that needs them)."""

    mesh: Mesh | jax.sharding.AbstractMesh
    rules: Rules
    # True inside the shard_map of data-parallel attention (`ced_jax.model.forward`): every array the
    # program sees is its device's block, and code that lays out its own work (the MoE) calls the
    # collectives directly instead of opening another shard_map.
    manual: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        return mesh_sizes(self.mesh)

    @property
    def attention_axes(self) -> tuple[str, ...]:
        """The mesh axes (of size > 1) over which attention is data-parallel: each device holds the
        pages of its own sequences (the `pages` rule). () when the pages are replicated."""
        return tuple(a for a in _mesh_axes_of(self.rules["pages"]) if self.sizes.get(a, 1) > 1)

    def row_spec(self, ndim: int, axis: int = 0) -> PartitionSpec:
        """An array of `ndim` dimensions whose dimension `axis` is the rows (sequences), split over
        the attention axes (the in/out specs of data-parallel attention's shard_map)."""
        axes = self.attention_axes
        entry = axes[0] if len(axes) == 1 else axes
        return PartitionSpec(*(entry if i == axis else None for i in range(ndim)))

    @property
    def attention_shards(self) -> int:
        return int(np.prod([self.sizes[a] for a in self.attention_axes])) if self.attention_axes else 1

    @property
    def batch_shards(self) -> int:
        """How many blocks the rows (the `batch` rule) split into: a row count must divide by it."""
        return int(np.prod([self.sizes.get(a, 1) for a in _mesh_axes_of(self.rules["batch"])]))

    def spec(
        self, axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None, *, name: str = "array"
    ) -> PartitionSpec:
        # Inside the shard_map an array is its device's block: its shape says nothing about division.
        return logical_to_spec(axes, self.rules, None if self.manual else shape, self.mesh, name=name)


def make_layout(mesh: Mesh | None, rules: str | Rules = DEFAULT_RULES) -> Layout | None:
    """The Layout of (mesh, rules); None on a single device (no mesh, or a mesh of one device),
    where nothing is laid out."""
    if mesh is None or int(np.prod(list(mesh_sizes(mesh).values()))) == 1:
        return None
    return Layout(mesh, get_rules(rules))


# ------------------------------------------------------------------ MoE expert parallelism
@dataclass(frozen=True)
class MoELayout:
    """How the routed experts sit on the mesh, derived from the rules (see ced_jax.model.layers.moe).

    ep_axis: mesh axis splitting the expert index (None: every device holds every expert);
    f_axis: mesh axis splitting w1/w3 along the hidden width F; d_axis: mesh axis splitting w2
    along its output width D; token_axes: the remaining mesh axes (size > 1), over which the
    tokens are split for dispatch (the expert-width axes need every token of their group)."""

    ep_axis: str | None
    f_axis: str | None
    d_axis: str | None
    token_axes: tuple[str, ...]
    sizes: dict[str, int]
    expert_specs: dict  # {'w1'|'w2'|'w3': {'weight'|'scale': PartitionSpec}}

    @property
    def token_shards(self) -> int:
        return int(np.prod([self.sizes[a] for a in self.token_axes])) if self.token_axes else 1

    def token_spec(self, ndim: int) -> PartitionSpec:
        """[tokens, ...] split over the token axes."""
        lead = self.token_axes if len(self.token_axes) > 1 else (self.token_axes or (None,))[0]
        return PartitionSpec(lead, *(None,) * (ndim - 1))


def moe_layout(layout: Layout, expert_axes: tuple[str | None, ...], experts: dict) -> MoELayout:
    """The expert-parallel layout for stacked experts {'w1'|'w2'|'w3': {'weight', 'scale'}} whose
    dimensions carry `expert_axes` (ced_jax.model.layers.moe.EXPERT_AXES)."""
    specs = {
        name: {
            part: layout.spec(expert_axes, tuple(arr.shape), name=f"routed experts {name}.{part}")
            for part, arr in w.items()
        }
        for name, w in experts.items()
    }

    def dim(name: str, i: int) -> str | None:
        got = {s[i] if i < len(s) else None for s in specs[name].values()}
        if len(got) != 1:  # weight and scale split differently: the shard_map could not pair them
            raise ValueError(f"expert {name}: weight and scale shard differently on dim {i}: {specs[name]}")
        return got.pop()

    ep = {dim(n, 0) for n in specs}
    if len(ep) != 1:
        raise ValueError(f"routed experts split their expert index differently: {specs}")
    f_axis = dim("w1", 1)
    if dim("w3", 1) != f_axis:
        raise ValueError(f"w1 and w3 must split F alike: {specs}")
    d_axis = dim("w2", 1)
    sizes = layout.sizes
    names = layout.mesh.axis_names
    token_axes = tuple(a for a in names if sizes[a] > 1 and a not in (f_axis, d_axis))
    return MoELayout(ep.pop(), f_axis, d_axis, token_axes, sizes, specs)
