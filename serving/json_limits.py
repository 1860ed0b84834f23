"""How deeply a client's JSON may nest: deepseek-recipe's reader (serde_json) refuses more than 128
levels with an error that names nothing, and Python's own parser raises RecursionError somewhat
deeper; both are checked first so that the answer is a client error that says so."""

from __future__ import annotations

from typing import Any

MAX_NESTING = 128


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0; stops counting past `limit`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((c, depth + 1) for c in children)
    return deepest
