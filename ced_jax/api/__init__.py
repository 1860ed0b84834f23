"""The notebook / CLI API: `load(path_or_preset)` -> `Model` with `generate`, `logits`, `describe`.

Its modules, each importing only those before it: `summary` (`describe`), `replay` (a golden fixture's
decisions and block inputs forced into `Model.logits`), `session` (`Session`: an `Engine` of one slot
or a few), `model` (`Model`), `loading` (`load`)."""

from ced_jax.api.loading import load
from ced_jax.api.model import Model
from ced_jax.api.replay import fixture_decisions
from ced_jax.api.session import Session
from ced_jax.api.summary import describe

__all__ = ["Model", "Session", "describe", "fixture_decisions", "load"]
