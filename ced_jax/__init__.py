"""ced_jax: DeepSeek-V4.1-Flash in JAX. The public API is this short list; modules are internals."""

from ced_jax.config import ConfigError, ModelConfig, preset

# The notebook API loads JAX and every layer: imported on first use, so that light modules
# (`ced_jax.options`, `ced_jax.config`, the chat encoding) stay light for the clients that need them.
_API = ("Model", "describe", "fixture_decisions", "load")


def __getattr__(name: str):
    if name in _API:
        from ced_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'ced_jax' has no attribute {name!r}")


__all__ = ["ConfigError", "Model", "ModelConfig", "describe", "fixture_decisions", "load", "preset"]
