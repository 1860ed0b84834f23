"""Prefill and decode throughput of ced_jax on one model, with the memory-bandwidth roofline.

    python bench/decode.py MODEL [--prefill 128 512] [--batch 1 8] [--decode-steps 16] [--repeats 3]
                                 [--generate-tokens 64] [--weight-layout stored|f32-dense|f32]

MODEL is a preset ('tiny') or a checkpoint directory (e.g. the `mid` checkpoint made by
`python bench/make_mid_weights.py --out /tmp/mid-ckpt`). Reports, as one JSON document:
- prefill tokens/s for each prompt length (batch 1, one chunk, median of `repeats`);
- decode tokens/s at each batch size (median per-step time over `decode-steps` after warm-up);
- peak RSS of the process after the prefills (before anything else ran) and at the end;
- `Model.generate` tokens/s at batch 1 (greedy, a 16-token prompt, `generate-tokens` new tokens,
  median of `repeats`; prefill and sampling included, as a user sees it);
- the machine's load average at the start and the end (the machine is shared);
- bytes of weights a decode step must read, in the stored formats (everything a token touches:
  attention, shared experts, router, mHC, norms, head, Engram projections and rows, plus the
  routed experts the batch actually selected, counted from the run), and the ratio of the implied
  read bandwidth to the machine's measured bandwidth (a jitted f32 sum over 1 GiB).
Compile time is excluded everywhere (each shape runs once before it is timed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ced_jax.api import load  # noqa: E402
from ced_jax.checkpoint.mapping import hf_inventory  # noqa: E402


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a jitted f32 sum over `gib` GiB, median of `repeats`."""
    n = int(gib * 2**30 // 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    del x
    return n * 4 / float(np.median(times))


def decode_weight_bytes(cfg, expert_ids: np.ndarray) -> float:
    """Stored bytes one decode step reads. expert_ids: [L, B, X] routed experts of that step."""
    inventory = hf_inventory(cfg)
    per_expert: dict[int, int] = {}
    dense = 0
    for name, spec in inventory.items():
        if spec.group != "backbone" or name.startswith("embed."):
            continue  # the embedding is a row lookup: B rows, negligible
        if ".ffn.experts." in name:
            layer = int(name.split(".")[1])
            per_expert[layer] = per_expert.get(layer, 0) + spec.nbytes // cfg.n_routed_experts
        else:
            dense += spec.nbytes
    experts = sum(len(np.unique(expert_ids[layer])) * per_expert[layer] for layer in range(cfg.num_layers))
    batch = expert_ids.shape[1]
    engram_rows = batch * len(cfg.engram_layer_ids) * cfg.engram_hash_cols * (cfg.engram_head_dim * 33 // 32)
    return dense + experts + engram_rows


def bench(
    model_name: str,
    prefill_lens,
    batches,
    decode_steps: int,
    repeats: int,
    generate_tokens: int,
    weight_layout: str | None = None,
    impl: str = "reference",
) -> dict:
    model = load(model_name, weight_layout=weight_layout, impl=impl)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    result: dict = {
        "model": model_name,
        "weight_layout": model.weight_layout,
        "load_average_start": os.getloadavg(),
        "prefill": {},
        "decode": {},
    }
    for length in prefill_lens:
        prompt = np.concatenate([[cfg.bos_token_id], rng.integers(8, cfg.vocab_size, length - 1)])[None]
        times = []
        for i in range(repeats + 1):
            session = model.new_session(1, length + 64)
            t0 = time.perf_counter()
            session.step(prompt)
            if i:  # the first run compiles
                times.append(time.perf_counter() - t0)
        result["prefill"][str(length)] = {
            "seconds": float(np.median(times)),
            "tokens_per_s": length / float(np.median(times)),
        }
    result["peak_rss_after_prefill_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    bandwidth = measure_bandwidth()
    result["machine_read_bandwidth_gb_s"] = bandwidth / 1e9
    for batch in batches:
        prompt_len = 64
        session = model.new_session(batch, prompt_len + decode_steps + 8)
        prompts = np.concatenate(
            [np.full((batch, 1), cfg.bos_token_id), rng.integers(8, cfg.vocab_size, (batch, prompt_len - 1))],
            axis=1,
        )
        logits, _ = session.step(prompts)
        tok = logits[:, -1].argmax(-1)[:, None]
        logits, aux = session.step(tok)  # compiles the decode program
        step_times, step_bytes = [], []
        for _ in range(decode_steps):
            tok = logits[:, -1].argmax(-1)[:, None]
            t0 = time.perf_counter()
            logits, aux = session.step(tok)
            step_times.append(time.perf_counter() - t0)
            step_bytes.append(decode_weight_bytes(cfg, aux["experts"][:, :, 0]))
        t = float(np.median(step_times))
        read = float(np.median(step_bytes))
        result["decode"][str(batch)] = {
            "seconds_per_step": t,
            "tokens_per_s": batch / t,
            "weight_bytes_per_step": read,
            "implied_read_gb_s": read / t / 1e9,
            "ratio_to_measured_bandwidth": read / t / bandwidth,
        }
    if generate_tokens:
        prompt = [cfg.bos_token_id] + rng.integers(8, cfg.vocab_size, 15).tolist()
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out = model.generate(prompt, generate_tokens, stop_at_eos=False)
            if i:  # the first run compiles
                times.append(time.perf_counter() - t0)
        result["generate"] = {
            "prompt_tokens": len(prompt),
            "new_tokens": len(out["token_ids"]),
            "seconds": float(np.median(times)),
            "tokens_per_s": len(out["token_ids"]) / float(np.median(times)),
        }
    result["load_average_end"] = os.getloadavg()
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["machine"] = {
        "cpus": os.cpu_count(),
        "devices": jax.device_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "backend": jax.default_backend(),
        "impl": impl,
        "weight_layout": model.weight_layout,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generate-tokens", type=int, default=64, help="0 skips the generate measurement")
    parser.add_argument(
        "--weight-layout",
        choices=("stored", "f32-dense", "f32"),
        default=None,
        help="ced_jax.checkpoint.weight_layout (default: the backend's default)",
    )
    parser.add_argument("--impl", default="reference", help="ced_jax.options.Impl: reference, cpu, pallas...")
    args = parser.parse_args()
    result = bench(
        args.model,
        args.prefill,
        args.batch,
        args.decode_steps,
        args.repeats,
        args.generate_tokens,
        weight_layout=args.weight_layout,
        impl=args.impl,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
