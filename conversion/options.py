"""What a conversion is asked to do (`ConvertOptions`), and the error it refuses with."""

from __future__ import annotations

from dataclasses import dataclass

from ced_jax.checkpoint.converted import EngramMode, WeightsDtype
from ced_jax.checkpoint.hf_loader import CheckpointError

INCLUDE_CHOICES = ("text", "dspark", "vision")


class ConversionError(CheckpointError):
    """A conversion that cannot be done as asked; the message names the file / tensor / option."""


@dataclass(frozen=True)
class ConvertOptions:
    # None: "text", plus "vision" when config.json describes a vision tower and "dspark" when it
    # describes DSpark stages whose tensors the index lists (`plan.default_include`, `conversion.convert`).
    include: tuple[str, ...] | None = None
    engram: EngramMode = "separate"
    weights_dtype: WeightsDtype = "native"
    overwrite: bool = False
    progress: bool = True
    compression: bool = True  # Orbax's zstd; off trades disk for speed on incompressible weights
    # With engram "separate" and native weights: also the raw memory-mappable tables (`RAW_DIR`).
    engram_raw: bool = True
