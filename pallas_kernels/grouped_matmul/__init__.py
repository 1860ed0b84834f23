"""FP4 grouped matmul (MoE experts): rows sorted by expert times per-expert packed FP4 weights.

`reference.gmm` (pure jnp) and `kernel.gmm` (Pallas: `kernel_tpu`, `kernel_triton`) share one
signature and `common.validate_inputs`."""

from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.common import TileConfig, validate_inputs
from pallas_kernels.grouped_matmul.kernel import gmm

__all__ = ["TileConfig", "gmm", "reference", "validate_inputs"]
