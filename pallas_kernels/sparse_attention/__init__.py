"""Paged sparse attention over packed FP8 window / FP4 compressed entries (V = K, one KV head, sink).

`reference` (pure jnp) and `kernel` (Pallas: `kernel_tpu`, `kernel_triton`) share the decode and
prefill signatures and `common.validate_inputs`; the contract is in `common`."""

from pallas_kernels.sparse_attention import reference
from pallas_kernels.sparse_attention.common import TileConfig, validate_inputs
from pallas_kernels.sparse_attention.kernel import sparse_attention_decode, sparse_attention_prefill

__all__ = [
    "TileConfig",
    "reference",
    "sparse_attention_decode",
    "sparse_attention_prefill",
    "validate_inputs",
]
