"""The static choices of a program run: which kernels (`Impl`), where the indexer's keys come from
(`IndexKeys`) and what a call captures (`RunOptions`). Parsed from text once, at the edge (a flag, a
`load(...)` argument); the model and its layers receive these values, never a mode string."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

PALLAS_BACKENDS = ("tpu", "gpu")
# How a prompt is prefilled: "exact" runs every layer over every prompt token; "ced" (spec 4.2, the
# causal encoder-decoder prefill) runs the decoder layers only over the prompt's last sliding window.
PREFILL_MODES = ("exact", "ced")


class Impl(NamedTuple):
    """kind "reference" (pure jnp: the default on CPU and the parity target), "pallas" (the
    `pallas_kernels` kernels: the backend's own, Mosaic on TPU and Triton on GPU, unless `backend`
    names one; `interpret` runs them in the Pallas HLO interpreter, how they run on CPU) or "cpu"
    (the CPU kernels built with ced-jax, `pallas_kernels._cpu`, where one exists; jnp elsewhere)."""

    kind: str
    backend: str | None = None
    interpret: bool = False

    @classmethod
    def parse(cls, text: str | Impl) -> Impl:
        """ "reference", "cpu" or "pallas[:tpu|:gpu][:interpret]"; NotImplementedError on anything else."""
        if isinstance(text, Impl):
            return text
        kind, *mods = text.split(":")
        backends = [m for m in mods if m in PALLAS_BACKENDS]
        bad = any(m not in (*PALLAS_BACKENDS, "interpret") for m in mods) or len(set(mods)) != len(mods)
        modifiers_misplaced = kind != "pallas" and mods
        if kind not in ("reference", "pallas", "cpu") or bad or len(backends) > 1 or modifiers_misplaced:
            raise NotImplementedError(
                f"impl={text!r} is not available; "
                "choose 'reference', 'cpu' or 'pallas[:tpu|:gpu][:interpret]'"
            )
        return cls(kind, backends[0] if backends else None, "interpret" in mods)

    @property
    def pallas(self) -> bool:
        return self.kind == "pallas"

    @property
    def cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def reads_packed_experts(self) -> bool:
        """The routed experts go to a kernel that decodes the packed FP4 itself (not the f32 layout)."""
        return self.kind in ("pallas", "cpu")

    def __str__(self) -> str:
        return ":".join(
            [self.kind, *([self.backend] if self.backend else []), *(["interpret"] * self.interpret)]
        )


REFERENCE = Impl("reference")


class IndexKeys(enum.StrEnum):
    """Where the indexer's keys come from (spec 3.3): "intended", the compressed index keys in the pages
    (the default); "reference", the released code's keys of the current chunk's positions."""

    INTENDED = "intended"
    REFERENCE = "reference"

    @classmethod
    def parse(cls, text: str | IndexKeys) -> IndexKeys:
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"index_k_mode must be 'intended' or 'reference', got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Everything static about one program call: a new value is a new executable.

    impl / index_keys: above. capture_blocks: `forward` also returns every block's input and the
    decisions taken (the notebook API's capture). stop_at_layer: `forward` stops before this layer
    (CED prefill's encoder pass: no logits). max_logprobs: top log-probabilities the sampler returns
    per token. step_tokens: a prefill's tokens per `forward` (None: a page)."""

    impl: Impl = REFERENCE
    index_keys: IndexKeys = IndexKeys.INTENDED
    capture_blocks: bool = False
    stop_at_layer: int | None = None
    max_logprobs: int = 0
    step_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "impl", Impl.parse(self.impl))
        object.__setattr__(self, "index_keys", IndexKeys.parse(self.index_keys))
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
