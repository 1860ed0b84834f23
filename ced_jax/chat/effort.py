"""The hosted API's thinking switch and reasoning-effort names, resolved to (thinking on?, prompt budget).

The encoder accepts only low/high/max and integers 1..100 (`encoding.EFFORT_BUDGETS`); the hosted API accepts
more names and maps them (spec 3.2). This is the request layer's half of that mapping.
"""

from __future__ import annotations

from typing import Any

from ced_jax.chat.encoding import EFFORT_BUDGETS, ChatFormatError

# Requested name -> the encoder's name (spec 3.2, DeepSeek's thinking_mode doc). "none" turns thinking off.
HOSTED_EFFORTS = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "high",
    "max": "max",
    "ultra": "max",
}
DEFAULT_BUDGET = EFFORT_BUDGETS["high"]
_THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}


def effort_budget(value: Any, field: str) -> int | None:
    """The prompt budget of an effort: an int 1..100, a hosted name, or None for "none" (thinking off)."""
    if type(value) is int:
        if not 1 <= value <= 100:
            raise ChatFormatError(f"{field}: integer effort must be in [1, 100], got {value}")
        return value
    if isinstance(value, str):
        if value == "none":
            return None
        if value in HOSTED_EFFORTS:
            return EFFORT_BUDGETS[HOSTED_EFFORTS[value]]
    names = ["none", *HOSTED_EFFORTS]
    raise ChatFormatError(
        f"{field}: invalid value {value!r}; expected one of {names} or an integer in [1, 100]"
    )


def resolve_thinking(
    body_thinking: Any, reasoning_effort: Any, default_thinking: bool = True
) -> tuple[bool, int | None]:
    """(thinking mode on?, prompt budget or None when thinking is off) for a request.

    `body_thinking`: the request's `thinking` object (`{"type": "enabled"|"adaptive"|"disabled"}`) or None.
    `reasoning_effort`: the request's effort (hosted name, "none", or a local integer 1..100) or None.
    `thinking: disabled` wins over any effort; effort "none" turns thinking off; the seed shape
    `thinking: {"type": "enabled", "effort": "high"}` supplies the effort when `reasoning_effort` is absent.
    """
    thinking = default_thinking
    nested_effort = None
    if body_thinking is not None:
        if not isinstance(body_thinking, dict):
            raise ChatFormatError('thinking: expected an object such as {"type": "enabled"}')
        kind = body_thinking.get("type")
        if kind not in _THINKING_TYPES:
            raise ChatFormatError(
                f"thinking.type: invalid value {kind!r}; expected one of {list(_THINKING_TYPES)}"
            )
        thinking = _THINKING_TYPES[kind]
        nested_effort = body_thinking.get("effort")

    if reasoning_effort is not None:
        budget = effort_budget(reasoning_effort, "reasoning_effort")
    elif nested_effort is not None:
        budget = effort_budget(nested_effort, "thinking.effort")
    else:
        budget = DEFAULT_BUDGET
    if budget is None or not thinking:
        return False, None
    return True, budget
