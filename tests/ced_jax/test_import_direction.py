"""Imports flow one way (README, "Layout"): `pallas_kernels` -> `ced_jax` -> `conversion`, `serving`
-> `ced_cli`. Checked on the source of every module with `ast`, so an import inside a function (a
lazy import, which an import-time check would miss) counts as much as one at the top."""

from __future__ import annotations

import ast

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
from ced_jax import ops

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
    """Issue 32 (the review found `serving.constraints` <-> `serving.scheduler`, through a lazy import):
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
