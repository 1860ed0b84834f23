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
               split without partial sums, see ced_jax.layers.moe)
- mlp          shared-expert hidden width
- engram_rows  Engram hash-table rows
- batch        sequences (cache and activations)

At run time the api enters `activate(mesh, rules)` while tracing; code that needs the layout
explicitly (the MoE's shard_map dispatch) reads it back with `current()` and derives its
PartitionSpecs through `logical_to_spec`, never writing one by hand.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
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
    # The Engram tables are not split: at full size they belong in host memory, where their rows
    # are gathered per token (spec 5.5); conversion.plan accounts for both placements.
    "engram_rows": None,
    "batch": "data",
}
# Pure tensor parallelism: experts split along their hidden width, everything else as above.
TP_RULES: Rules = {**EP_TP_RULES, "experts": None}
# Everything replicated (single device, or a reference run on a mesh).
REPLICATED_RULES: Rules = dict.fromkeys(LOGICAL_AXES)

RULES = {"ep_tp": EP_TP_RULES, "tp": TP_RULES, "replicated": REPLICATED_RULES}
DEFAULT_RULES = "ep_tp"


def get_rules(rules: str | Rules) -> Rules:
    """A rules table by name ('ep_tp', 'tp', 'replicated') or as given, checked."""
    if isinstance(rules, str):
        if rules not in RULES:
            raise ValueError(f"unknown sharding rules {rules!r}; known: {sorted(RULES)}")
        rules = RULES[rules]
    check_rules(rules)
    return rules


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
) -> PartitionSpec:
    """Logical axes -> PartitionSpec. A mesh axis is used at most once per array; a dimension that
    the mesh axis does not divide stays replicated (checked, never silently wrong); a mesh axis the
    mesh lacks, or of size 1, is dropped so that specs stay comparable across meshes."""
    sizes = None if mesh is None else mesh_sizes(mesh)
    used: set[str] = set()
    out: list[str | None] = []
    for i, axis in enumerate(axes):
        mesh_axis = None if axis is None else rules.get(axis)
        if mesh_axis is not None and sizes is not None and sizes.get(mesh_axis, 1) == 1:
            mesh_axis = None
        if mesh_axis is not None and (
            mesh_axis in used
            or (sizes is not None and shape is not None and shape[i] % sizes[mesh_axis] != 0)
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


def logical_shardings(axes, arrays, mesh: Mesh, rules: Rules):
    """Shardings for a tree of arrays (or ShapeDtypeStructs) given a same-shaped tree of logical-axis
    tuples (e.g. `ced_jax.cache.paged_cache_axes`)."""
    return jax.tree.map(
        lambda ax, a: NamedSharding(mesh, logical_to_spec(ax, rules, a.shape, mesh)),
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


# ------------------------------------------------------------------ the active layout (trace time)
@dataclass(frozen=True)
class Layout:
    """The mesh and rules a program is traced under."""

    mesh: Mesh | jax.sharding.AbstractMesh
    rules: Rules

    @property
    def sizes(self) -> dict[str, int]:
        return mesh_sizes(self.mesh)

    def spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None) -> PartitionSpec:
        return logical_to_spec(axes, self.rules, shape, self.mesh)


_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("ced_jax_layout", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh | None, rules: str | Rules = DEFAULT_RULES) -> Iterator[None]:
    """Make (mesh, rules) the layout that `current()` reports while tracing. mesh None: no-op."""
    if mesh is None:
        yield
        return
    token = _ACTIVE.set(Layout(mesh, get_rules(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> Layout | None:
    """The active layout: the one `activate` set, else the ambient mesh (jax.set_mesh) with the
    default rules; None on a single device (no mesh, or a mesh of one device)."""
    layout = _ACTIVE.get()
    if layout is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            return None
        layout = Layout(mesh, RULES[DEFAULT_RULES])
    if int(np.prod(list(layout.sizes.values()))) == 1:
        return None
    return layout


# ------------------------------------------------------------------ MoE expert parallelism
@dataclass(frozen=True)
class MoELayout:
    """How the routed experts sit on the mesh, derived from the rules (see ced_jax.layers.moe).

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
    dimensions carry `expert_axes` (ced_jax.layers.moe.EXPERT_AXES)."""
    specs = {
        name: {part: layout.spec(expert_axes, tuple(arr.shape)) for part, arr in w.items()}
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
