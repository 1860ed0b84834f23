"""mHC mixing (the per-site pre / post / Sinkhorn-normalised comb of `ced_jax.layers.mhc`) as one
kernel per site. `reference` (pure jnp) and `kernel` (Pallas: `kernel_tpu`, `kernel_triton`) share
one signature and `common.validate_inputs`; the contract is in `common`."""

from pallas_kernels.mhc import reference
from pallas_kernels.mhc.common import TileConfig, validate_inputs
from pallas_kernels.mhc.kernel import hc_mixes

__all__ = ["TileConfig", "hc_mixes", "reference", "validate_inputs"]
