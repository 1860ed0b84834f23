"""Which Pallas backend a kernel call runs on: explicit, or the default device's."""

from __future__ import annotations

import jax

BACKENDS = ("gpu", "tpu")


def resolve_backend(backend: str | None, interpret) -> str:
    """'tpu' or 'gpu' for an explicit or default backend; raises on a CPU without interpret."""
    if backend is None:
        platform = jax.default_backend()
        if platform == "cpu" and not interpret:
            raise NotImplementedError("Pallas kernels need a TPU or GPU; on CPU pass interpret=True")
        backend = "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"
    if backend not in BACKENDS:
        raise NotImplementedError(f"backend={backend!r}; choose one of {sorted(BACKENDS)}")
    return backend
