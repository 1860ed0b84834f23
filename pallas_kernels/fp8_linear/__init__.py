"""The FP8 block-scaled linear (e4m3 weights with ue8m0 scales per 32 x 32 block): `reference` (jnp,
the XLA path's product, and the kernels' order stated in numpy) and `kernel_cpu` (the CPU kernel)."""

from pallas_kernels.fp8_linear import reference

__all__ = ["reference"]
