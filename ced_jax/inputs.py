"""The per-row inputs of a program call besides tokens and metadata, as plain dataclasses: host numpy
arrays where the scheduler and the serving engines build them, device arrays inside a program
(`ced_jax.engine.batch` registers them as pytrees). No JAX here, so the serving front end and the
client can hold them without importing it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters (`ced_jax.sampling.sample`): temperature f32 [B] (0: greedy), top_p
    f32 [B] (1: off), top_k i32 [B] (0: off), seed u32 [B], token_bitmask i32 [B, W] (a speculative
    step's [B, K+1, W]: the mask for the token after j accepted drafts; all ones: unconstrained)."""

    temperature: Any
    top_p: Any
    top_k: Any
    seed: Any
    token_bitmask: Any = None

    @classmethod
    def broadcast(
        cls, rows: int, temperature=0.0, top_p=1.0, top_k=0, seed=0, token_bitmask=None
    ) -> SamplingBatch:
        """Host sampling inputs of `rows` rows, each parameter a number or one value per row (the
        engine's host calls fill a None token_bitmask with ones)."""
        row = lambda v, dtype: np.broadcast_to(np.asarray(v, dtype), (rows,)).copy()  # noqa: E731
        return cls(
            row(temperature, np.float32), row(top_p, np.float32), row(top_k, np.int32), row(seed, np.uint32),
            token_bitmask,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """Image spans of a chunk (spec 6.3): token_types i32 [B, T] (-1 text, 0..3 a span's START /
    IMAGE / NEWLINE / END) and span_embeds f32 [B, T, D] (the ViT + aligner rows and delimiters)."""

    token_types: Any
    span_embeds: Any


@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """A speculative step's drafts: drafts i32 [B, w] (each row's previous next_drafts) and n_drafts
    i32 [B] in 0..w, how many of a row's drafts the step verifies."""

    drafts: Any
    n_drafts: Any

    @property
    def width(self) -> int:
        return int(np.shape(self.drafts)[1])
