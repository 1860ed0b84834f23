"""Builds the CPU kernels' shared library (pallas_kernels/csrc) against the XLA FFI headers that jaxlib
ships. Optional: without a C++ compiler the install succeeds and the CPU kernels say they are missing
(pallas_kernels._cpu). Everything else about the package is in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir() -> str:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("jaxlib (the XLA FFI headers) is not installed in the build environment")
    return str(Path(next(iter(spec.submodule_search_locations))) / "include")


class OptionalBuildExt(build_ext):
    """A failed build is a warning: ced-jax runs without its CPU kernels."""

    def build_extension(self, ext):
        try:
            ext.extra_compile_args = [*ext.extra_compile_args, "-isystem", _ffi_include_dir()]
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any failure leaves the kernels unbuilt, never the install
            print(f"ced-jax: the CPU kernels were not built ({e}); the XLA path still works")


CPU_KERNELS = Extension(
    "pallas_kernels._cpu_kernels",
    sources=[
        "pallas_kernels/csrc/fp4_expert_rows.cc",
        "pallas_kernels/csrc/fp8_linear_rows.cc",
        "pallas_kernels/csrc/index_scores.cc",
        "pallas_kernels/csrc/materialize.cc",
    ],
    depends=["pallas_kernels/csrc/shared_work.h", "pallas_kernels/csrc/cpu_common.h"],
    language="c++",
    # No -ffast-math and no -march: the order of every float operation is the one written, and the
    # AVX-512 loops are chosen at run time (function targets), so one build runs on any x86-64 CPU.
    extra_compile_args=["-std=c++17", "-O2", "-fno-fast-math", "-ffp-contract=off"],
    optional=True,
)

setup(ext_modules=[CPU_KERNELS], cmdclass={"build_ext": OptionalBuildExt})
