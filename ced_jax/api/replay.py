"""Teacher forcing in `Model.logits`: a golden fixture's recorded decisions replayed (routing, index
top-k) and its block inputs patched in, checked by name and shape, fed piece by piece; and the
decisions a run takes, collected per phase."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ced_jax.config import ModelConfig

_FIXTURE_MODES = ("intended", "reference")


def is_fixture(arrays: dict | None) -> bool:
    """A golden fixture's expected.safetensors (its decode arrays are recorded per index-key mode)."""
    return bool(arrays) and any(k.startswith(("decode_intended_", "decode_reference_")) for k in arrays)


def fixture_decisions(fixture: dict, index_k_mode: str = "intended") -> tuple[dict, dict]:
    """(replay, patch) for `Model.logits` from a golden fixture's arrays (`expected.safetensors`, as
    loaded): the recorded routing and top-k rows, and the block inputs, of the prefill and of the
    decode run in `index_k_mode`. `logits` applies it itself to a fixture given as replay or patch."""
    if index_k_mode not in _FIXTURE_MODES:
        raise ValueError(f"index_k_mode must be one of {list(_FIXTURE_MODES)}, got {index_k_mode!r}")

    layers = sorted({k.rsplit("topk_layer", 1)[1] for k in fixture if re.fullmatch(r".+_topk_layer\d+", k)})
    replay, patch = {}, {}
    for phase in ("prefill", "decode"):
        source = "prefill_" if phase == "prefill" else f"decode_{index_k_mode}_"
        for name in ("gate_indices", *(f"topk_layer{layer}" for layer in layers)):
            if source + name in fixture:
                replay[f"{phase}_{name}"] = fixture[source + name]
        for name in ("block_input", "pre_mix_input"):
            if source + name in fixture:
                patch[f"{phase}_{name}"] = fixture[source + name]
    return replay, patch


def check_replay_patch(cfg: ModelConfig, replay: dict, patch: dict, t: int, n: int) -> None:
    """Validate replay / patch arrays by name and shape so a wrong file fails with a clear error."""
    L, k, M, D = cfg.num_layers, cfg.num_experts_per_tok, cfg.hc_mult, cfg.hidden_size
    expected: dict[str, tuple] = {
        "prefill_gate_indices": (L, t, k),
        "decode_gate_indices": (n, L, k),
        "prefill_block_input": (L, t, M, D),
        "prefill_pre_mix_input": (L, t, M),
        "decode_block_input": (n, L, M, D),
        "decode_pre_mix_input": (n, L, M),
    }
    for layer in cfg.index_source_layer_ids:  # any width up to index_topk: -1 marks unused slots
        expected[f"prefill_topk_layer{layer}"] = (t, None)
        expected[f"decode_topk_layer{layer}"] = (n, None)
    for source, what in ((replay, "replay"), (patch, "patch")):
        for name, arr in source.items():
            if name not in expected:
                raise ValueError(f"{what}: unknown array {name!r}")
            shape = expected[name]
            got = tuple(np.shape(arr))
            if len(got) != len(shape) or any(
                s is not None and s != g for s, g in zip(shape, got, strict=False)
            ):
                raise ValueError(f"{what}: {name} has shape {list(got)}, expected {list(shape)} (None = any)")
    for a, b in (
        ("prefill_block_input", "prefill_pre_mix_input"),
        ("decode_block_input", "decode_pre_mix_input"),
    ):
        if (a in patch) != (b in patch):
            raise ValueError(f"patch: {a} and {b} must be given together")


def pad_axis(a: np.ndarray, axis: int, width: int, value=0) -> np.ndarray:
    """`a` padded with `value` at the end of `axis` to `width` entries."""
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, width - a.shape[axis])
    return np.pad(a, pad, constant_values=value)


def pad_forced(forced: dict | None, width: int) -> dict | None:
    """A prefill piece's forced decisions and block inputs padded to `width` positions (their padding
    is never used: those positions are not written and their outputs are dropped)."""
    if forced is None:
        return None
    out = dict(forced)
    if "topk" in out:
        out["topk"] = {k: pad_axis(v, 1, width) for k, v in out["topk"].items()}
    if "experts" in out:
        out["experts"] = pad_axis(out["experts"], 2, width)
    for name in ("block_input", "pre_mix"):
        if name in out:
            out[name] = {k: pad_axis(v, 1, width) for k, v in out[name].items()}
    return out


def forced_slice(
    cfg: ModelConfig, replay: dict, patch: dict, phase: str, where, patch_layers: Sequence[int] | None = None
) -> dict | None:
    """Forced decisions/inputs for one prefill chunk (where = slice of tokens) or decode step (int);
    block inputs are patched for `patch_layers` only (None: every layer)."""
    forced: dict[str, Any] = {}
    topk = {}
    for layer in cfg.index_source_layer_ids:
        arr = replay.get(f"{phase}_topk_layer{layer}")
        if arr is not None:
            a = np.asarray(arr, np.int32)
            topk[str(layer)] = a[where][None] if phase == "prefill" else a[where][None, None]
    if topk:
        forced["topk"] = topk
    gates = replay.get(f"{phase}_gate_indices")
    if gates is not None:
        g = np.asarray(gates, np.int32)
        forced["experts"] = g[:, where][:, None] if phase == "prefill" else g[where][:, None, None]
    block = patch.get(f"{phase}_block_input")
    if block is not None:
        pre = np.asarray(patch[f"{phase}_pre_mix_input"], np.float32)
        block = np.asarray(block, np.float32)
        chosen = range(cfg.num_layers) if patch_layers is None else patch_layers
        if phase == "prefill":  # [L, T, ...] -> {layer: [1, T_chunk, ...]}
            forced["block_input"] = {str(i): block[i, where][None] for i in chosen}
            forced["pre_mix"] = {str(i): pre[i, where][None] for i in chosen}
        else:  # [N, L, ...] -> {layer: [1, 1, ...]}
            forced["block_input"] = {str(i): block[where, i][None, None] for i in chosen}
            forced["pre_mix"] = {str(i): pre[where, i][None, None] for i in chosen}
    return forced or None


def collect_decisions(
    out: dict, aux: dict, phase: str, capture_blocks: bool, batch_index: int, length: int | None = None
) -> None:
    """Appends one step's decisions (prefill: the first `length` positions, the rest being padding)."""
    for layer, topk in aux["topk"].items():
        out.setdefault(f"{phase}_topk_layer{layer}", []).append(topk[batch_index, :length])
    experts = aux["experts"][:, batch_index, :length]  # [L, T, X]
    out.setdefault(f"{phase}_gate_indices", []).append(
        experts if phase == "prefill" else experts.transpose(1, 0, 2)
    )
    if capture_blocks:
        blocks = aux["block_output"][:, batch_index, :length]  # [L, T, M, D]
        out.setdefault(f"{phase}_block_output", []).append(
            blocks if phase == "prefill" else blocks.transpose(1, 0, 2, 3)
        )


def concat_axis(name: str) -> int:
    """The axis along which the collected steps of array `name` join (the prefill's [L, T, ...] on T)."""
    return 1 if name in ("prefill_gate_indices", "prefill_block_output") else 0
