"""What one program call consumes besides the parameters and the state: one `StepBatch`, a pytree
whose array fields are the program's inputs (a None field is no input, and a separate executable),
with its `SamplingBatch` and `ImageInputs` (`ced_jax.inputs`, registered as pytrees here). The
static choices of the call travel beside it in `ced_jax.options.RunOptions`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ced_jax.cache import StepMetadata
from ced_jax.inputs import ImageInputs, SamplingBatch


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
