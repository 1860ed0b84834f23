"""The Pallas mHC mixing over the per-backend kernels; see
`pallas_kernels._backend.resolve_backend` for the backend choice. No fallback."""

from __future__ import annotations

import jax

from pallas_kernels._backend import resolve_backend
from pallas_kernels.mhc import kernel_tpu, kernel_triton
from pallas_kernels.mhc.common import TileConfig

_MODULES = {"tpu": kernel_tpu, "gpu": kernel_triton}


def hc_mixes(
    x: jax.Array,  # f32 [T, hc * D]
    fn: jax.Array,  # f32 [(2 + hc) * hc, hc * D]
    scale: jax.Array,  # f32 [3]
    base: jax.Array,  # f32 [(2 + hc) * hc]
    *,
    hc: int,
    iters: int,
    norm_eps: float,
    hc_eps: float,
    backend: str | None = None,
    interpret=False,
    config: TileConfig | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # pre [T, hc], post [T, hc], comb [T, hc, hc]
    module = _MODULES[resolve_backend(backend, interpret)]
    return module.hc_mixes(
        x, fn, scale, base, hc=hc, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps,
        interpret=interpret, config=config,
    )  # fmt: skip
