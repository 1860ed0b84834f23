"""The Pallas grouped matmul: one entry point over the per-backend kernels.

backend "tpu" runs `kernel_tpu` (Mosaic), "gpu" runs `kernel_triton`; None picks the default
backend's (CPU needs `interpret`, and then runs the TPU kernel in the HLO interpreter). Nothing
falls back: an unsupported shape or tile raises NotImplementedError while tracing.
"""

from __future__ import annotations

import jax

from pallas_kernels._backend import resolve_backend
from pallas_kernels.grouped_matmul import kernel_tpu, kernel_triton
from pallas_kernels.grouped_matmul.common import TileConfig

KERNELS = {"tpu": kernel_tpu.gmm, "gpu": kernel_triton.gmm}


def gmm(
    lhs: jax.Array,  # f32 [M, K], rows sorted by expert
    w_packed: jax.Array,  # u8 [E, N, K/2]
    w_scale: jax.Array,  # u8 [E, N, K/32]
    group_sizes: jax.Array,  # i32 [E]
    *,
    backend: str | None = None,
    interpret=False,
    config: TileConfig | None = None,
) -> jax.Array:  # f32 [M, N]
    """Same contract as `reference.gmm` (see `common`)."""
    return KERNELS[resolve_backend(backend, interpret)](
        lhs, w_packed, w_scale, group_sizes, interpret=interpret, config=config
    )
