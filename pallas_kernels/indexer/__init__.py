"""Indexer scoring (relu-weighted head sum over paged FP4 index keys) and top-k selection.

`reference` (pure jnp) and `kernel` (Pallas scoring: `kernel_tpu`, `kernel_triton`; top-k in XLA)
share one signature and `common.validate_inputs`; the contract is in `common`."""

from pallas_kernels.indexer import reference
from pallas_kernels.indexer.common import TileConfig, select_topk, validate_inputs
from pallas_kernels.indexer.kernel import index_scores, index_topk

__all__ = ["TileConfig", "index_scores", "index_topk", "reference", "select_topk", "validate_inputs"]
