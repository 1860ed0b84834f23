"""The FP8 block-scaled linear on this CPU: the CPU kernel (`pallas_kernels.fp8_linear.kernel_cpu`,
the e4m3 weight decoded inside the dot) against the XLA path (`fp8_linear.reference.linear`: the
weight dequantised, then an f32 dot) and an f32 dot over a weight dequantised beforehand (what the
"f32-dense" weight layout runs).

    python bench/fp8_linear.py [--rows 1 8] [--shapes 1024x1024 4096x1024 1024x4096] [--repeats 30]

Prints one JSON line per (rows, N x K): median ms of each (after one untimed call) and the kernel's
ns per weight. FP8-quantised random rows and weights; the cost does not depend on the values."""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import _cpu, formats
from pallas_kernels.fp8_linear import kernel_cpu, reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_check import time_call  # noqa: E402  (the bench scripts' one median timer)


def _median_ms(fn, args, repeats: int) -> float:
    return 1e3 * time_call(fn, args, repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=["1024x1024", "4096x1024", "1024x4096"], help="N x K")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(json.dumps({"load_start": os.getloadavg(), "vector_width": _cpu.vector_width()}), flush=True)
    for m in args.rows:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            rows = rng.standard_normal((m, k)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            weight = rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn)
            scales = np.full((-(-n // 32), k // 32), 120, np.uint8)
            dense = np.asarray(jax.jit(formats.dequant_fp8_weight)(weight, scales))
            # Two rows at least: a one-row f32 dot is a matrix-vector product (`ced_jax.invariant`).
            padded = np.pad(rows, ((0, max(0, 2 - m)), (0, 0)))
            # On the device once: numpy arguments would be copied in on every timed call.
            rows, weight, scales, dense, padded = map(jnp.asarray, (rows, weight, scales, dense, padded))
            kernel = _median_ms(jax.jit(kernel_cpu.linear_rows), (rows, weight, scales), args.repeats)
            xla = _median_ms(jax.jit(reference.linear), (rows, weight, scales), args.repeats)
            f32_dot = jax.jit(lambda x, w: jnp.dot(x, w.T, precision="highest"))
            f32 = _median_ms(f32_dot, (padded, dense), args.repeats)
            print(json.dumps({
                "rows": m, "n": n, "k": k, "kernel_ms": kernel, "xla_dequant_dot_ms": xla, "f32_dot_ms": f32,
                "kernel_ns_per_weight": kernel * 1e6 / (n * k),
            }), flush=True)  # fmt: skip
    print(json.dumps({"load_end": os.getloadavg()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
