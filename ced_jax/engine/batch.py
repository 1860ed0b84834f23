"""What one program call consumes besides the parameters and the state: one `StepBatch`, a pytree
whose array fields are the program's inputs (a None field is no input, and a separate executable).
The static choices of the call travel beside it in `ced_jax.options.RunOptions`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ced_jax.cache import StepMetadata


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
class StepBatch:
    """tokens i32 [B] (decode), [B, T] (a chunk: step, prefill; a speculative step's last token and
    its drafts); meta: the rows (`StepMetadata`); engram: the Engram inputs of the tokens (hash ids,
    or the gathered rows when the tables are on the host; None without Engram); sampling: for the
    programs that sample; images: image spans, None for text; forced: `forward`'s replayed decisions
    and patches (the notebook API's `step` only)."""

    tokens: Any
    meta: StepMetadata
    engram: Any = None
    sampling: SamplingBatch | None = None
    images: ImageInputs | None = None
    forced: dict | None = None


for _cls in (SamplingBatch, ImageInputs, StepBatch):
    jax.tree_util.register_dataclass(
        _cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[]
    )
