"""mHC mixing (the per-site pre / post / Sinkhorn-normalised comb of `ced_jax.model.layers.mhc`) as one
kernel per site. `reference` (pure jnp) and `kernel` (Pallas: `kernel_tpu`, `kernel_triton`) share
one signature and `common.validate_inputs`; the contract is in `common`.

Not used by the model yet: in interpret mode the kernels equal `ced_jax.model.layers.mhc.hc_mixes` compiled
on its own and inside the library's programs, but inside the server's decode program on 8 CPU
devices XLA:CPU's fusion choices move the reference's own projection by an ulp in some steps (up to
1.4e-5 in the mixes), which the served pallas-against-reference gate sees as 0.2-nat log-prob
differences (BENCHMARKS.md, "The mHC mixing as one kernel per site")."""

from pallas_kernels.mhc import reference
from pallas_kernels.mhc.common import TileConfig, validate_inputs
from pallas_kernels.mhc.kernel import hc_mixes

__all__ = ["TileConfig", "hc_mixes", "reference", "validate_inputs"]
