"""No module docstring is longer than the code it explains (a package's layout and the architecture
belong in README.md and docs/, which say it once)."""

from __future__ import annotations

import ast

from tests.conftest import REPO

PACKAGES = ("pallas_kernels", "ced_jax", "conversion", "serving", "ced_cli", "bench")


def docstring_and_code_lines(source: str) -> tuple[int, int]:
    """The module docstring's lines (0 without one) and the code lines after it: neither blank nor
    only a comment."""
    body = ast.parse(source).body
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
        return 0, 0
    if not isinstance(body[0].value.value, str):
        return 0, 0
    doc = body[0]
    after = source.splitlines()[doc.end_lineno :]
    code = [line for line in after if line.strip() and not line.lstrip().startswith("#")]
    return doc.end_lineno - doc.lineno + 1, len(code)


def test_counts():
    assert docstring_and_code_lines('"""One.\n\nTwo."""\n\n# why\nx = 1\n') == (3, 1)
    assert docstring_and_code_lines("x = 1\n") == (0, 0)


def test_no_module_docstring_is_longer_than_its_code():
    """One line is always allowed: what a module or package (an `__init__.py` without code) holds."""
    too_long = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            doc, code = docstring_and_code_lines(path.read_text())
            if doc > max(code, 1):
                too_long.append(f"{path.relative_to(REPO)}: {doc} docstring lines, {code} of code")
    assert not too_long, "\n".join(too_long)
