"""ced_jax: DeepSeek-V4.1-Flash in JAX. The public API is this short list; modules are internals."""

from ced_jax.api import Model, describe, fixture_decisions, load
from ced_jax.config import ConfigError, ModelConfig, preset

__all__ = ["ConfigError", "Model", "ModelConfig", "describe", "fixture_decisions", "load", "preset"]
