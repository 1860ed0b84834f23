"""ced_jax.chat.resolve_thinking: the hosted API's thinking switch and effort names (spec 3.2)."""

import pytest

from ced_jax.chat import ChatFormatError, resolve_thinking


@pytest.mark.parametrize(
    ("effort", "budget"),
    [
        (None, 75),
        ("minimal", 50),
        ("low", 50),
        ("medium", 75),
        ("high", 75),
        ("xhigh", 75),
        ("max", 100),
        ("ultra", 100),
        (1, 1),
        (37, 37),
        (100, 100),
    ],
)
def test_effort_table(effort, budget):
    assert resolve_thinking(None, effort) == (True, budget)
    assert resolve_thinking({"type": "enabled"}, effort) == (True, budget)
    assert resolve_thinking({"type": "adaptive"}, effort) == (True, budget)


def test_none_and_disabled_turn_thinking_off():
    assert resolve_thinking(None, "none") == (False, None)
    assert resolve_thinking({"type": "enabled"}, "none") == (False, None)
    assert resolve_thinking({"type": "disabled"}, "max") == (False, None)
    assert resolve_thinking({"type": "disabled"}, None) == (False, None)
    assert resolve_thinking(None, None, default_thinking=False) == (False, None)
    assert resolve_thinking({"type": "enabled"}, None, default_thinking=False) == (True, 75)


def test_seed_shape_effort_inside_thinking():
    assert resolve_thinking({"type": "enabled", "effort": "low"}, None) == (True, 50)
    assert resolve_thinking({"type": "enabled", "effort": "max"}, None) == (True, 100)
    # reasoning_effort, when given, wins over the nested one.
    assert resolve_thinking({"type": "enabled", "effort": "max"}, "low") == (True, 50)
    assert resolve_thinking({"type": "enabled", "effort": "none"}, None) == (False, None)


@pytest.mark.parametrize(
    ("thinking", "effort", "field"),
    [
        (None, "extreme", "reasoning_effort"),
        (None, 0, "reasoning_effort"),
        (None, 101, "reasoning_effort"),
        (None, True, "reasoning_effort"),
        (None, 50.0, "reasoning_effort"),
        ({"type": "enabled", "effort": "huge"}, None, "thinking.effort"),
        ({"type": "on"}, None, "thinking.type"),
        ("enabled", None, "thinking"),
    ],
)
def test_bad_values_name_the_field(thinking, effort, field):
    with pytest.raises(ChatFormatError, match=field.replace(".", r"\.")):
        resolve_thinking(thinking, effort)
