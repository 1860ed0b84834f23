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
