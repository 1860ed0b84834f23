"""The CPU kernels' shared library (`pallas_kernels/csrc`, built by `pip install` where a C++ compiler
exists): found, loaded and registered with XLA's FFI once, or one line saying why not."""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

import jax

LIBRARY_NAME = "_cpu_kernels"
# XLA FFI target name -> the handler symbol the library exports.
TARGETS = {
    "ced_fp4_expert_rows": "CedFp4ExpertRows",
    "ced_fp8_linear_rows": "CedFp8LinearRows",
    "ced_index_scores": "CedIndexScores",
    "ced_materialize": "CedMaterialize",
}


class CpuKernelsUnavailable(NotImplementedError):
    """The CPU kernels were not built on this machine."""


def library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARY_NAME}{suffix}"
        if path.exists():
            return path
    return None


@functools.cache
def _load() -> ctypes.CDLL | str:
    path = library_path()
    if path is None:
        return (
            "the CPU kernels are not built (no C++ compiler when ced-jax was installed): install g++ and run "
            "`pip install -e .` again, or choose impl='reference'"
        )
    lib = ctypes.CDLL(str(path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def require() -> None:
    """Registers the CPU kernels with XLA; raises CpuKernelsUnavailable (one line) where not built."""
    loaded = _load()
    if isinstance(loaded, str):
        raise CpuKernelsUnavailable(loaded)


def available() -> bool:
    return not isinstance(_load(), str)


def vector_width() -> int:
    """The widest vector loops the kernels run on this CPU: 512 (AVX-512), 256 (AVX2) or 0."""
    require()
    return int(_load().ced_cpu_kernels_isa())


def materialized(x: jax.Array) -> jax.Array:
    """x itself, computed once into a buffer its consumers read (`csrc/materialize.cc`): XLA:CPU
    would otherwise recompute an elementwise producer inside each consumer's fusion."""
    require()
    call = jax.ffi.ffi_call(
        "ced_materialize", jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0}
    )
    return call(x)
