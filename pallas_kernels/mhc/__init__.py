"""mHC mixing (`ced_jax.model.layers.mhc`'s pre / post / Sinkhorn comb) as one kernel per site:
`reference` (jnp) and `kernel` (Pallas) share one signature, whose contract is in `common`. Not used
by the model yet: XLA:CPU moves the reference's projection by an ulp inside the server's decode
program, which the pallas gate sees (BENCHMARKS.md, "The mHC mixing as one kernel per site")."""

from pallas_kernels.mhc import reference
from pallas_kernels.mhc.common import TileConfig, validate_inputs
from pallas_kernels.mhc.kernel import hc_mixes

__all__ = ["TileConfig", "hc_mixes", "reference", "validate_inputs"]
