"""The model: its abstract parameter tree (`params`), the one `forward` (`forward`), its layers
(`layers`, with the seam to the kernels in `layers.kernels`) and the DSpark draft stages (`dspark`)."""

from ced_jax.model.forward import forward
from ced_jax.model.params import (
    BF16,
    E8M0,
    F32,
    FP4X2,
    FP8,
    ParamSpec,
    dspark_param_specs,
    flatten_specs,
    param_specs,
)

__all__ = [
    "BF16",
    "E8M0",
    "F32",
    "FP4X2",
    "FP8",
    "ParamSpec",
    "dspark_param_specs",
    "flatten_specs",
    "forward",
    "param_specs",
]
