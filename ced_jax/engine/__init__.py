"""The engine: one device state, the programs every client runs (`programs`), the typed batch they
take (`batch`), the host side that builds it (`host`) and page copies (`page_io`)."""

from ced_jax.engine.batch import ImageInputs, SamplingBatch, StepBatch
from ced_jax.engine.host import PROGRAMS, Engine, LoadedModel, SpeculativeOutput
from ced_jax.engine.programs import (
    Programs,
    StateShapes,
    new_state,
    replay_tokens,
    state_shardings,
)

__all__ = [
    "PROGRAMS",
    "Engine",
    "ImageInputs",
    "LoadedModel",
    "Programs",
    "SamplingBatch",
    "SpeculativeOutput",
    "StateShapes",
    "StepBatch",
    "new_state",
    "replay_tokens",
    "state_shardings",
]
