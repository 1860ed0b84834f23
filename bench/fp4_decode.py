"""What the routed experts of one decode step cost on this backend, part by part: the FP4 decode of
the selected experts' weights and the f32 products on them (issue 10.4's decode goals).

    python bench/fp4_decode.py /tmp/mid-ckpt [--batch 1 8] [--repeats 15] [--json out.json]

The config (a checkpoint directory or a preset) gives the shapes: a decode step at batch B gathers
B x top-k entries per MoE layer, each with w1 and w3 [F, D] and w2 [D, F] as packed FP4 codes
[N, K/2] + ue8m0 scales [N, K/32]. Random codes and realistic scale exponents (2^-9 .. 2^2, so no
product is subnormal) stand in for the weights: the cost does not depend on the values.

For each batch size, per weight shape, the median time (after one untimed call) of:
- `decode:table`: `pallas_kernels.formats.dequant_fp4_weight` on the gathered entries, as the model runs it
  (a 256-entry table of byte -> two values, then the block scales);
- `decode:bits`: the same values built from the code bits per 16-byte scale block (bit-identical; a
  candidate that was measured and not taken);
- `convert floor`: `uint8 -> f32` of the same codes written out twice, the cheapest elementwise op with
  the same input and output bytes (no decoding at all): a floor for any decode XLA:CPU fuses;
- `products`: the per-entry two-row products on already-decoded f32 weights (`kernels.expert_matmul`'s
  decode path after the decode);
- `expert_matmul`: `kernels.expert_matmul` as the model calls it (gather, decode and products; past
  `kernels.EXPERT_DECODE_GROUP` entries a group at a time);
- `cpu kernel`: `kernels.expert_matmul` with impl="cpu", the FP4 expert kernel of `pallas_kernels._cpu`
  (decoding inside the dot, nothing written out), where it is built.
and, per step, the sum over the MoE layers and the three matrices of `expert_matmul`, of `decode:table
+ products` (the whole batch decoded at once), and of the convert floor + products, with the tokens/s
each allows for the routed experts alone (everything else in the step costs extra). The process's
CPU time over wall time tells how many of the machine's cores the fusions used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ced_jax.config import ModelConfig, preset  # noqa: E402
from ced_jax.model.layers import kernels  # noqa: E402
from ced_jax.options import Impl  # noqa: E402
from pallas_kernels import _cpu, formats  # noqa: E402


def _decode_from_bits(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """The values of `formats.dequant_fp4_weight`, from the code bits per 16-byte scale block."""
    lead, half = packed.shape[:-1], packed.shape[-1]
    codes = packed.astype(jnp.int32).reshape(*lead, half // 16, 16)
    block_scale = formats.ue8m0_to_f32(scale)[..., None]

    def values(c):
        magnitude = c & 7
        bits = (magnitude + 252 - (magnitude == 1).astype(jnp.int32)) << 22
        bits = jnp.where(magnitude == 0, 0, bits | ((c >> 3) << 31))
        return jax.lax.bitcast_convert_type(bits, jnp.float32) * block_scale

    return jnp.stack([values(codes & 15), values(codes >> 4)], axis=-1).reshape(*lead, half * 2)


def _convert_floor(packed: jax.Array, scale: jax.Array) -> jax.Array:
    del scale
    return jnp.repeat(packed.astype(jnp.float32), 2, axis=-1)


def _timed(fn, *args, repeats: int) -> tuple[float, float]:
    """Median wall seconds of `repeats` calls, and the process's CPU seconds over wall seconds."""
    jax.block_until_ready(fn(*args))
    walls, cpu0, wall0 = [], time.process_time(), time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t)
    return float(np.median(walls)), (time.process_time() - cpu0) / (time.perf_counter() - wall0)


# Per MoE layer: w1 and w3 are [F, D], w2 is [D, F].
MATRICES = {"w1/w3 [F, D]": 2, "w2 [D, F]": 1}


def _step_ms(per_shape: dict, decode_label: str, num_moe_layers: int) -> float:
    """One decode step's routed experts with `decode_label`'s decode, then the products."""
    per_layer = sum(
        count * (per_shape[name][decode_label]["ms"] + per_shape[name]["products"]["ms"])
        for name, count in MATRICES.items()
    )
    return per_layer * num_moe_layers


def _load_config(model: str) -> ModelConfig:
    if Path(model).is_dir():
        return ModelConfig.from_pretrained(model)
    return preset(model)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory (config.json) or preset name")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        cfg = _load_config(args.model)
    except (OSError, ValueError) as err:
        ap.error(f"model {args.model!r}: {err}")
    num_moe_layers = cfg.num_layers  # every layer's FFN is a MoE (shared + routed experts)
    d, f, e, topk = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    rng = np.random.default_rng(0)
    shapes = {"w1/w3 [F, D]": (f, d), "w2 [D, F]": (d, f)}
    stacks = {
        name: (
            jnp.asarray(rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)),
            jnp.asarray(rng.integers(118, 130, (e, n, k // 32), dtype=np.uint8)),
        )
        for name, (n, k) in shapes.items()
    }
    decoders = {"decode:table": formats.dequant_fp4_weight, "decode:bits": _decode_from_bits,
                "convert floor": _convert_floor}  # fmt: skip
    hi = jax.lax.Precision.HIGHEST
    report = {
        "model": args.model, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "jax": jax.__version__, "load_average_start": os.getloadavg()[0], "batches": {},
    }  # fmt: skip
    for batch in args.batch:
        entries = batch * topk
        ids = jnp.asarray(rng.integers(0, e, entries).astype(np.int32))
        per_shape = {}
        for name, (packed, scale) in stacks.items():
            n, k = shapes[name]
            row = {}
            for label, decode in decoders.items():
                fn = jax.jit(lambda i, p, s, decode=decode: decode(p[i], s[i]))
                seconds, cores = _timed(fn, ids, packed, scale, repeats=args.repeats)
                row[label] = {"ms": seconds * 1e3, "ns_per_value": seconds * 1e9 / (entries * n * k),
                              "cpu_per_wall": cores}  # fmt: skip
            assert np.array_equal(
                np.asarray(jax.jit(formats.dequant_fp4_weight)(packed[ids], scale[ids])).view(np.uint32),
                np.asarray(jax.jit(_decode_from_bits)(packed[ids], scale[ids])).view(np.uint32),
            ), "the bit decode must give the table's values"
            weight = jax.jit(formats.dequant_fp4_weight)(packed[ids], scale[ids])
            rows = jnp.asarray(rng.standard_normal((entries, k)).astype(np.float32))
            products = jax.jit(
                lambda r, w: jnp.einsum("mik,mnk->min", jnp.stack([r, jnp.zeros_like(r)], 1), w, precision=hi)
            )
            seconds, cores = _timed(products, rows, weight, repeats=args.repeats)
            row["products"] = {"ms": seconds * 1e3, "cpu_per_wall": cores}
            shipped = jax.jit(lambda r, i, p, s: kernels.expert_matmul(r, i, {"weight": p, "scale": s}))
            seconds, cores = _timed(shipped, rows, ids, packed, scale, repeats=args.repeats)
            row["expert_matmul"] = {"ms": seconds * 1e3, "cpu_per_wall": cores}
            if _cpu.available():
                w = {"weight": packed, "scale": scale}
                kernel = jax.jit(lambda r, i, w=w: kernels.expert_matmul(r, i, w, impl=Impl("cpu")))
                seconds, cores = _timed(kernel, rows, ids, repeats=args.repeats)
                row["cpu kernel"] = {"ms": seconds * 1e3, "ns_per_value": seconds * 1e9 / (entries * n * k),
                                     "cpu_per_wall": cores}  # fmt: skip
            per_shape[name] = row
        table_ms = _step_ms(per_shape, "decode:table", num_moe_layers)
        shipped_ms = num_moe_layers * sum(
            count * per_shape[name]["expert_matmul"]["ms"] for name, count in MATRICES.items()
        )
        floor_ms = _step_ms(per_shape, "convert floor", num_moe_layers)
        no_kernel = {"ms": float("nan")}
        cpu_ms = num_moe_layers * sum(
            count * per_shape[name].get("cpu kernel", no_kernel)["ms"] for name, count in MATRICES.items()
        )
        report["batches"][str(batch)] = {
            "cpu_kernel_ms_per_step": cpu_ms,
            "cpu_kernel_tok_s_bound": batch * 1e3 / cpu_ms,
            "entries_per_layer": entries,
            "values_per_step": num_moe_layers * entries * 3 * d * f,
            "shapes": per_shape,
            "expert_matmul_ms_per_step": shipped_ms,
            "expert_matmul_tok_s_bound": batch * 1e3 / shipped_ms,
            "routed_experts_ms_per_step": table_ms,
            "routed_experts_tok_s_bound": batch * 1e3 / table_ms,
            "convert_floor_ms_per_step": floor_ms,
            "convert_floor_tok_s_bound": batch * 1e3 / floor_ms,
        }
    report["load_average_end"] = os.getloadavg()[0]
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return report


if __name__ == "__main__":
    main()
