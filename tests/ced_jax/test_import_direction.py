"""Imports flow one way (README, "Layout"): `pallas_kernels` -> `ced_jax` -> `conversion`, `serving`
-> `ced_cli`, and inside `ced_jax` by the layer table below. Checked on the source of every module
with `ast`, so an import inside a function (a lazy import, which an import-time check would miss)
counts as much as one at the top."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

PACKAGES = ("pallas_kernels", "ced_jax", "conversion", "serving", "ced_cli")
# What each package may import of ours (itself included); everything else of ours is an upward import.
ALLOWED = {
    "pallas_kernels": {"pallas_kernels"},
    "ced_jax": {"pallas_kernels", "ced_jax"},
}


def imported_modules(source: str, module: str) -> set[str]:
    """Every module `source` (the text of `module`, dotted) imports, wherever the statement sits:
    import / from-import statements (relative ones resolved against `module`), and
    importlib.import_module / __import__ calls with a literal name."""
    found: set[str] = set()
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            else:
                found.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def upward_imports(package: str) -> list[str]:
    """'file: module' for each import of one of our packages that `package` may not import."""
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for name in sorted(imported_modules(path.read_text(), module)):
            top = name.split(".")[0]
            if top in PACKAGES and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(REPO)}: {name}")
    return bad


def test_the_walker_sees_lazy_relative_and_dynamic_imports():
    source = """
import numpy as np
from ced_jax import sharding

def load():
    from conversion.convert import load_flat
    import serving.config
    if True:
        from ..serving import jax_engine
    return importlib.import_module("ced_cli.main"), __import__("conversion")
"""
    found = imported_modules(source, "ced_jax.sub.module")
    assert {"conversion.convert", "serving.config", "ced_jax.serving", "ced_cli.main", "conversion"} <= found
    assert {"numpy", "ced_jax"} <= found


# Inside ced_jax: each module belongs to the group of its longest matching prefix, and imports only
# from the groups its group lists (itself included). `engine` and `checkpoint` are siblings: neither
# imports the other; `model` never reads a checkpoint; nothing below `api` imports `api`. The notebook
# API's own modules are layered too: `loading` makes a `Model`, which makes `Session`s, and the parts
# under them (with `generation`, `training`, `testing`) import none of the three.
CED_JAX_GROUPS = {
    "core": (
        "ced_jax.config", "ced_jax.options", "ced_jax.sharding", "ced_jax.quant", "ced_jax.invariant",
        "ced_jax.sampling", "ced_jax.cache", "ced_jax.engram_hash", "ced_jax.engram_store",
        "ced_jax.text_ids", "ced_jax.compile_cache", "ced_jax.chat", "ced_jax.trees", "ced_jax.inputs",
    ),
    "layers": ("ced_jax.model.layers",),
    "model": ("ced_jax.model", "ced_jax.vision"),
    "engine": ("ced_jax.engine",),
    "checkpoint": ("ced_jax.checkpoint",),
    "api.parts": (
        "ced_jax.generation", "ced_jax.training", "ced_jax.testing",
        "ced_jax.api.summary", "ced_jax.api.replay", "ced_jax.api.session",
    ),
    "api.model": ("ced_jax.api.model",),
    "api.loading": ("ced_jax.api.loading",),
    "api": ("ced_jax", "ced_jax.api"),
}  # fmt: skip
_BELOW_API = {"core", "layers", "model", "engine", "checkpoint"}
CED_JAX_MAY_IMPORT = {
    "core": {"core"},
    "layers": {"core", "layers"},
    "model": {"core", "layers", "model"},
    "engine": {"core", "layers", "model", "engine"},
    "checkpoint": {"core", "layers", "model", "checkpoint"},
    "api.parts": _BELOW_API | {"api.parts"},
    "api.model": _BELOW_API | {"api.parts", "api.model"},
    "api.loading": _BELOW_API | {"api.parts", "api.model", "api.loading"},
    "api": set(CED_JAX_GROUPS),
}


def group_of(module: str, groups: dict[str, tuple[str, ...]]) -> str:
    """The group whose longest prefix names `module` (KeyError: a module the table does not place)."""
    best = max(
        (
            (len(p), g)
            for g, prefixes in groups.items()
            for p in prefixes
            if module == p or module.startswith(p + ".")
        ),
        default=None,
    )
    if best is None:
        raise KeyError(f"{module}: not in the layer table")
    return best[1]


def package_modules(package: str) -> dict[str, object]:
    """dotted module name -> path of every module of `package` (a package by its own name)."""
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        if "_pb2" not in path.name:
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_within(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (`from pkg import module` counts as the module;
    importing a package counts as its __init__)."""
    modules = package_modules(package)

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        source = path.read_text()
        names = imported_modules(source, module)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        names.discard(node.module)  # `from ced_jax import sharding` is not ced_jax/__init__
                        names.add(f"{node.module}.{alias.name}")
        graph[module] = {d for d in map(ours, names) if d and d != module}
    return graph


def layer_violations(package: str, groups: dict, may_import: dict) -> list[str]:
    bad = []
    for module, deps in imports_within(package).items():
        mine = group_of(module, groups)
        for dep in sorted(deps):
            theirs = group_of(dep, groups)
            if theirs not in may_import[mine]:
                bad.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return bad


def test_ced_jax_layers():
    assert layer_violations("ced_jax", CED_JAX_GROUPS, CED_JAX_MAY_IMPORT) == []


# Inside serving: request errors and the engine protocol at the bottom; the features (constraints,
# text, tenants, files, ...) on them; the serve config; the scheduler's parts (pages, KV tiers, prefix,
# placement, speculation, validation, streams: none imports the scheduler) and on them the scheduler,
# the engine implementations (siblings of both that meet them only through the protocol), the planner
# and the test doubles; the front ends (HTTP, the gRPC service); the server.
SERVING_GROUPS = {
    "base": (
        "serving", "serving.errors", "serving.engine.protocol", "serving.json_limits", "serving.proto",
        "serving.cli_help", "serving.flags",
    ),
    "features": (
        "serving.accounting", "serving.admission", "serving.model_names", "serving.files", "serving.tenants",
        "serving.image_fetch", "serving.work_pools", "serving.metrics", "serving.text", "serving.vision",
        "serving.constraints", "serving.chat", "serving.requests",
    ),
    "config": ("serving.config",),
    "engines": ("serving.engine",),
    "scheduling": ("serving.scheduling",),
    "scheduler": ("serving.scheduling.scheduler",),
    "planning": ("serving.planning",),
    "doubles": ("serving.testing.mock_engine",),
    "http": ("serving.http",),
    "grpc": ("serving.grpc_service",),
    "server": ("serving.server", "serving.client", "serving.testing"),
}  # fmt: skip
_BELOW_CONFIG = {"base", "features", "config"}
SERVING_MAY_IMPORT = {
    "base": {"base"},
    "features": {"base", "features"},
    "config": _BELOW_CONFIG,
    "engines": _BELOW_CONFIG | {"engines"},
    "scheduling": _BELOW_CONFIG | {"scheduling"},
    "scheduler": _BELOW_CONFIG | {"scheduling", "scheduler"},
    "planning": _BELOW_CONFIG | {"planning"},
    "doubles": _BELOW_CONFIG | {"doubles"},
    "http": _BELOW_CONFIG | {"scheduling", "scheduler", "http"},
    "grpc": _BELOW_CONFIG | {"scheduling", "scheduler", "grpc"},
    "server": set(SERVING_GROUPS),
}


def test_serving_layers():
    assert layer_violations("serving", SERVING_GROUPS, SERVING_MAY_IMPORT) == []


# Inside conversion: options, signals, progress and the test checkpoints at the bottom; the validation
# pass (with its config explanations); reading a shard into a group's leaves; the output directory;
# writing; `convert`, which puts them together; the command line on top.
CONVERSION_GROUPS = {
    "base": (
        "conversion", "conversion.options", "conversion.interrupt", "conversion.progress",
        "conversion.save_noise", "conversion.synthetic",
    ),
    "plan": ("conversion.plan", "conversion.explain"),
    "reading": ("conversion.stream", "conversion.groups"),
    "outdir": ("conversion.outdir",),
    "write": ("conversion.write",),
    "convert": ("conversion.convert",),
    "cli": ("conversion.cli",),
}  # fmt: skip
CONVERSION_MAY_IMPORT = {
    "base": {"base"},
    "plan": {"base", "plan"},
    "reading": {"base", "plan", "reading"},
    "outdir": {"base", "outdir"},
    "write": {"base", "plan", "reading", "write"},
    "convert": {"base", "plan", "outdir", "write", "convert"},
    "cli": set(CONVERSION_GROUPS),
}


def test_conversion_layers():
    assert layer_violations("conversion", CONVERSION_GROUPS, CONVERSION_MAY_IMPORT) == []


# Inside pallas_kernels: the codecs, tile helpers and backend choice at the bottom; in each kernel
# package its contract (`common`), then the reference and the backends (TPU, GPU, CPU), then the entry point
# (`kernel`), then the package; no kernel package imports another.
KERNEL_PACKAGES = ("grouped_matmul", "indexer", "mhc", "sparse_attention")
KERNEL_ROLES = (("common",), ("reference", "kernel_tpu", "kernel_triton", "kernel_cpu"), ("kernel",), ("",))
PALLAS_GROUPS = {
    "base": (
        "pallas_kernels",
        "pallas_kernels.formats",
        "pallas_kernels._tiles",
        "pallas_kernels._backend",
        "pallas_kernels._cpu",
    ),  # fmt: skip
}
PALLAS_MAY_IMPORT = {"base": {"base"}}
for _kernel in KERNEL_PACKAGES:
    _below = {"base"}
    for _level, _roles in enumerate(KERNEL_ROLES):
        _name = f"{_kernel}.{_level}"
        PALLAS_GROUPS[_name] = tuple(f"pallas_kernels.{_kernel}" + (f".{r}" if r else "") for r in _roles)
        PALLAS_MAY_IMPORT[_name] = _below | {_name}
        _below = _below | {_name}


def test_pallas_kernels_layers():
    assert layer_violations("pallas_kernels", PALLAS_GROUPS, PALLAS_MAY_IMPORT) == []


# Inside ced_cli: the shared options at the bottom, then `serve` (whose flags `compile` reuses), then
# the other commands, then `main`, which only dispatches.
CED_CLI_GROUPS = {
    "options": ("ced_cli", "ced_cli.options"),
    "serve": ("ced_cli.serve",),
    "commands": tuple(f"ced_cli.{c}" for c in ("convert", "describe", "generate", "logits", "plan",
                                                "precompile", "train_draft")),
    "main": ("ced_cli.main",),
}  # fmt: skip
CED_CLI_MAY_IMPORT = {
    "options": {"options"},
    "serve": {"options", "serve"},
    "commands": {"options", "serve"},
    "main": set(CED_CLI_GROUPS),
}


def test_ced_cli_layers():
    assert layer_violations("ced_cli", CED_CLI_GROUPS, CED_CLI_MAY_IMPORT) == []


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    import tests.ced_jax.test_import_direction as here

    for name, text in {
        "ced_jax/__init__.py": "",
        "ced_jax/config.py": "",
        "ced_jax/model/__init__.py": "from ced_jax import config\n",
        "ced_jax/model/layers/__init__.py": "",
        "ced_jax/model/layers/moe.py": "def f():\n    from ced_jax.model import forward\n",
        "ced_jax/model/forward.py": "",
        "ced_jax/engine/__init__.py": "from ced_jax.checkpoint import place\n",
        "ced_jax/checkpoint/__init__.py": "",
        "ced_jax/checkpoint/place.py": "import ced_jax.model\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(here, "REPO", tmp_path)
    assert layer_violations("ced_jax", CED_JAX_GROUPS, CED_JAX_MAY_IMPORT) == [
        "ced_jax.engine (engine) imports ced_jax.checkpoint.place (checkpoint)",
        "ced_jax.model.layers.moe (layers) imports ced_jax.model.forward (model)",
    ]
    with pytest.raises(KeyError, match="not in the layer table"):
        group_of("ced_jax_extra.thing", CED_JAX_GROUPS)


def test_ced_jax_imports_neither_conversion_nor_serving_nor_the_cli():
    assert len(list((REPO / "ced_jax").rglob("*.py"))) > 20  # the walk really covers the package
    assert upward_imports("ced_jax") == []


def test_pallas_kernels_import_nothing_of_ours():
    assert len(list((REPO / "pallas_kernels").rglob("*.py"))) > 5
    assert upward_imports("pallas_kernels") == []


def import_cycles(package: str) -> list[list[str]]:
    """The groups of `package`'s modules that import each other round in a circle (lazy imports too)."""
    modules = {}
    for path in sorted((REPO / package).rglob("*.py")):
        if "_pb2" not in path.name:
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def ours(name: str) -> str | None:  # `from serving.http import app` names a module or a package
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def imports_of(module: str, path) -> set[str]:
        names = imported_modules(path.read_text(), module)
        for node in ast.walk(ast.parse(path.read_text())):  # `from pkg import module` imports the module
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        # Importing `pkg.sub` runs `pkg/__init__` first, but a module's own packages are no cycle.
        ancestors = {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}
        return {d for d in map(ours, names) if d and d != module and d not in ancestors}

    graph = {m: imports_of(m, p) for m, p in modules.items()}
    # Tarjan's strongly connected components; a component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_package_has_an_import_cycle():
    """Issue 32 (the review found `serving.constraints` <-> `serving.scheduling.scheduler`, through a lazy
    import):
    the request errors now live at the bottom, in `serving.errors`."""
    for package in PACKAGES:
        assert import_cycles(package) == [], package


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path, monkeypatch):
    import tests.ced_jax.test_import_direction as here

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    monkeypatch.setattr(here, "REPO", tmp_path)
    assert import_cycles("pkg") == [["pkg.a", "pkg.b"]]
