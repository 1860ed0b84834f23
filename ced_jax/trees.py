"""The one walk between flat parameter names and nested trees: 'layers.3.attn.wq_a.weight' is
tree['layers']['3']['attn']['wq_a']['weight'] (the released checkpoint's names, our parameter tree,
the Orbax item layout)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def nest(flat: Mapping[str, Any], leaf: Callable[[str, Any], Any] = lambda name, value: value) -> dict:
    """{dotted name: value} -> the nested dict {part: {...: leaf(name, value)}}."""
    root: dict = {}
    for name, value in flat.items():
        node = root
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf(name, value)
    return root


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The inverse of `nest`: nested dicts -> {dotted name: leaf} (a leaf is anything but a dict)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
