"""The scheduler's DSpark bookkeeping (`scheduler.py`'s module docstring, "Speculative decoding"):
each slot's drafts from its last step, how many of them the next step verifies and at which width,
and the check of what a verify step emitted. Building the step and consuming its tokens stay in the
scheduler."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.engine.protocol import EngineSpec


class DraftBook:
    """Each slot's drafts for its next speculative step: the previous step's next_drafts and their
    confidences; a count of 0 means none yet (right after its prefill, or after a plain step)."""

    def __init__(self, spec: EngineSpec, k: int, threshold: float | None):
        """k: `ServeConfig.dspark` (at most this many drafts a row); threshold: `dspark_confidence`."""
        self.k, self.threshold = k, threshold
        self.widths = tuple(w for w in spec.dspark_widths if w <= k)  # the compiled widths usable at k
        S, kmax = spec.max_slots, max(spec.dspark_max_drafts, 1)
        self.drafts = np.zeros((S, kmax), np.int32)
        self.confidence = np.zeros((S, kmax), np.float32)
        self.count = np.zeros(S, np.int32)

    def plan(self, rows: Sequence[tuple[int, int, int]]) -> tuple[int, np.ndarray]:
        """(width, n_drafts [S]) of a speculative step over `rows`, each (slot, tokens the request may
        still generate, positions its pages hold past its last token): each row's drafts to verify
        and the narrowest usable width that holds them all; width 0 = a plain step (a row's pages
        cannot hold even the narrowest width)."""
        n_drafts = np.zeros(len(self.count), np.int32)
        cap = self.k
        for slot, tokens_left, room in rows:
            n = min(self.k, int(self.count[slot]), tokens_left - 1)
            if self.threshold is not None and n > 0:
                n = confident_length(self.confidence[slot, :n], self.threshold)
            n_drafts[slot] = n
            # The engine may write up to `width` positions past the last token: within the pages.
            cap = min(cap, room)
        wanted = max(1, int(n_drafts.max()))
        fits = [w for w in self.widths if w <= cap]
        width = next((w for w in fits if w >= wanted), fits[-1] if fits else 0)
        return width, np.minimum(n_drafts, width)

    def block(self, width: int) -> np.ndarray:
        """The [S, width] drafts a step of that width sends."""
        return np.ascontiguousarray(self.drafts[:, :width])

    def keep(self, slot: int, next_drafts: np.ndarray, next_confidence: np.ndarray) -> None:
        """Stores a row's drafts (and confidences) from its last step for its next one."""
        kmax = len(next_drafts)
        self.drafts[slot, :kmax] = next_drafts
        self.confidence[slot, :kmax] = next_confidence
        self.count[slot] = kmax

    def forget(self, slots) -> None:
        """The slots have no drafts (a plain step drafts nothing; a slot released or just prefilled)."""
        self.count[slots] = 0


def check_emitted(slot: int, emitted: int, n_drafts: int) -> None:
    """A verify step emits 1 + the drafts it accepted for a row, so 1..n_drafts + 1 tokens; anything
    else is an engine bug (RuntimeError)."""
    if not 1 <= emitted <= n_drafts + 1:
        raise RuntimeError(f"slot {slot}: the engine emitted {emitted} tokens for {n_drafts} drafts")


def confident_length(confidence: np.ndarray, threshold: float) -> int:
    """How many drafts a row verifies under `dspark_confidence`: the longest prefix of its drafts
    whose running product of sigmoid(confidence) stays >= threshold, at least 1 (the verify program
    has a draft position anyway). The rule of `ced_jax.model.dspark.confident_prefix`, here without JAX."""
    odds = 1.0 / (1.0 + np.exp(-np.asarray(confidence, np.float64)))
    return max(1, int(np.sum(np.cumprod(odds) >= threshold)))  # the product only falls
