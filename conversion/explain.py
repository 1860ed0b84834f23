"""The config.json entries behind a tensor the config does not describe: which entry decides its shape or
its existence, and which value would match the checkpoint. Only runs on the way to an error."""

from __future__ import annotations

import copy

from ced_jax.checkpoint.mapping import TensorSpec, hf_inventory
from ced_jax.config import ModelConfig

# config.json entries that may decide a tensor's shape or existence, as paths into the JSON:
# (section, key) for an integer, (section, key, i) for an element of a list of integers.
# weight_block_size is a [B, B] pair and varied as one.
_BLOCK_KEY = ("quantization_config", "weight_block_size")
_KeyPath = tuple  # (str, str) or (str, str, int)


def _integer_keys(raw: dict, *, elements: bool) -> list[_KeyPath]:
    """The integer entries of config.json (`elements`: the elements of its integer lists instead)."""
    keys: list[_KeyPath] = []
    if not elements and isinstance(raw.get(_BLOCK_KEY[0]), dict):
        keys.append(_BLOCK_KEY)
    for section in ("text_config", "vision_config"):
        values = raw.get(section)
        for k, v in values.items() if isinstance(values, dict) else ():
            if not elements and isinstance(v, int) and not isinstance(v, bool):
                keys.append((section, k))
            if elements and isinstance(v, list) and all(isinstance(x, int) for x in v):
                keys += [(section, k, i) for i in range(len(v))]
    return keys


def _key_value(raw: dict, key: _KeyPath) -> int:
    value = raw[key[0]][key[1]]
    return value[key[2]] if len(key) == 3 else value[0] if key == _BLOCK_KEY else value


def _format_key(key: _KeyPath, value: int) -> str:
    index = f"[{key[2]}]" if len(key) == 3 else ""
    return f"{key[0]}.{key[1]}{index}={value}"


def _inventory_with(raw: dict, key: _KeyPath, value: int) -> dict[str, TensorSpec] | None:
    """The inventory config.json would give with `key` set to `value`; None when that config is not
    one the model accepts."""
    trial = copy.deepcopy(raw)
    if len(key) == 3:
        trial[key[0]][key[1]][key[2]] = value
    else:
        trial[key[0]][key[1]] = [value, value] if key == _BLOCK_KEY else value
    try:
        return hf_inventory(ModelConfig.from_hf_config(trial))
    except Exception:  # noqa: BLE001 - any failure means "not a candidate"; this is a probe, not a load
        return None


def _trial_values(value: int) -> list[int]:
    # One step either way finds counts (experts, layers, heads); doubling / halving keeps the
    # multiples of 32 that head and block sizes need.
    return [v for v in dict.fromkeys((value + 1, value - 1, value * 2, value // 2)) if v >= 0 and v != value]


def explain_shape(raw: dict, name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> str:
    """Which config.json entries decide the dimensions in which tensor `name` differs from what the
    config implies, found by varying each integer entry and rebuilding the inventory (the mapping is
    the only place that knows the formulas), and which value of one would give the stored shape.
    Only runs on the way to an error: about a second per entry on the full release config."""
    if len(expected) != len(got):
        return ""
    differing = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    deciding: list[str] = []
    matching: list[str] = []
    for elements in (False, True):  # the elements of lists (per-layer entries) only when no scalar decides
        for key in _integer_keys(raw, elements=elements):
            value = _key_value(raw, key)
            shapes: dict[int, tuple[int, ...]] = {}
            for trial in _trial_values(value):
                inv = _inventory_with(raw, key, trial)
                shape = None if inv is None or name not in inv else inv[name].shape
                if shape is not None and len(shape) == len(expected):
                    moved = any(shape[i] != expected[i] for i in differing)
                    if not moved and not shapes:
                        break  # the first trial that builds leaves those dimensions alone: not this entry
                    shapes[trial] = shape
            if not any(any(sh[i] != expected[i] for i in differing) for sh in shapes.values()):
                continue
            deciding.append(_format_key(key, value))
            # A dimension is affine in one entry (ceil-divided for scales, hence every trial's
            # slope): solve on the first differing dimension, confirm with a rebuilt inventory.
            i = differing[0]
            candidates = [t for t, sh in shapes.items() if sh == got]
            for trial, shape in shapes.items():
                slope = (shape[i] - expected[i]) / (trial - value)
                if slope:
                    candidates.append(round(value + (got[i] - expected[i]) / slope))
            for candidate in dict.fromkeys(c for c in candidates if c >= 0 and c != value):
                inv = _inventory_with(raw, key, candidate)
                if inv is not None and name in inv and inv[name].shape == got:
                    matching.append(_format_key(key, candidate))
                    break
        if deciding:
            break
    if matching:
        return f"decided by config.json's {', '.join(deciding)}; {' or '.join(matching)} would match it"
    if deciding:
        return f"decided by config.json's {', '.join(deciding)}"
    return ""


def explain_names(raw: dict, name: str, *, present: bool) -> str:
    """Which config.json entry decides whether tensor `name` exists: one whose variation makes it
    appear (present=True: the checkpoint has it, the config does not) or disappear."""
    for elements in (False, True):
        keys = _integer_keys(raw, elements=elements)
        for steps in (slice(0, 2), slice(2, 4)):  # one step first (counts), then doubling / halving
            for key in keys:
                value = _key_value(raw, key)
                for trial in _trial_values(value)[steps]:
                    inv = _inventory_with(raw, key, trial)
                    if inv is not None and (name in inv) == present:
                        return f"whether it is expected is decided by config.json's {_format_key(key, value)}"
    return ""
