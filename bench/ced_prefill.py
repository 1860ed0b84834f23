"""CED prefill against exact prefill: next-token distribution and prefill speed.

    python bench/ced_prefill.py MODEL [--lengths 64 256 1024 2048] [--prompts 4] [--repeats 3]

MODEL is a preset ('tiny') or a checkpoint directory (tests/golden/tiny-a, the `mid` checkpoint made
by `python bench/make_mid_weights.py --out /tmp/mid-ckpt`, or any checkpoint in the released layout).
For each prompt length, `--prompts` prompts of random token ids (seeded) are prefilled three ways:
exact (every layer over every token), ced (`--prefill-mode ced`: the encoder layers over the whole
prompt, the decoder layers over its last sliding window) and last-window-only (the model sees only
the prompt's last `sliding_window` tokens: what the decoder would know with no encoder at all).
Reports, as one JSON document, per length:
- KL(exact || ced) and KL(exact || last window) of the next-token distribution after the prompt
  (mean and max over the prompts) and their ratio; argmax agreement of ced and of last-window with
  exact;
- prefill tokens/s of the server's prefill program (`ced_jax.engine.programs.prefill_batch`, one row, the
  prompt in one chunk, a page of `--page-size` tokens per loop iteration) in exact and in ced mode,
  measured alternately in one run (median of `--repeats`, compile excluded), and the speed-up.
The machine is shared: the load average at the start and the end is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402

from ced_jax.api import load  # noqa: E402
from ced_jax.engine import Engine, SamplingBatch, StateShapes  # noqa: E402
from ced_jax.generation import prefill_split  # noqa: E402


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of two next-token distributions given as logits."""
    p, q = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.sum(np.exp(p) * (p - q)))


def next_token_logits(model, ids: list[int], mode: str, chunk: int) -> np.ndarray:
    return model.logits(ids, prefill_chunk=chunk, prefill_mode=mode)["prefill_logits_full"][-1]


def quality(model, length: int, prompts: int, seed: int, chunk: int) -> dict:
    cfg = model.cfg
    rng = np.random.default_rng(seed + length)
    rows = []
    for _ in range(prompts):
        ids = rng.integers(3, cfg.vocab_size, length).tolist()
        exact = next_token_logits(model, ids, "exact", chunk)
        ced = next_token_logits(model, ids, "ced", chunk)
        window = next_token_logits(model, ids[-cfg.sliding_window :], "exact", chunk)
        rows.append(
            {
                "kl_ced": kl(exact, ced),
                "kl_window": kl(exact, window),
                "argmax_ced": int(exact.argmax() == ced.argmax()),
                "argmax_window": int(exact.argmax() == window.argmax()),
            }
        )
    kl_ced = [r["kl_ced"] for r in rows]
    kl_window = [r["kl_window"] for r in rows]
    return {
        "kl_exact_ced_mean": float(np.mean(kl_ced)),
        "kl_exact_ced_max": float(np.max(kl_ced)),
        "kl_exact_last_window_mean": float(np.mean(kl_window)),
        "kl_exact_last_window_max": float(np.max(kl_window)),
        "kl_ratio_mean": float(np.mean(kl_ced) / max(np.mean(kl_window), 1e-30)),
        "argmax_agreement_ced": float(np.mean([r["argmax_ced"] for r in rows])),
        "argmax_agreement_last_window": float(np.mean([r["argmax_window"] for r in rows])),
    }


def speed(model, length: int, repeats: int, seed: int, page: int) -> dict:
    """Prefill tokens/s of the server's prefill program (pages of `page` tokens), exact and ced
    alternately."""
    cfg = model.cfg
    context = -(-(length + 1) // page) * page
    shapes = StateShapes(max_slots=1, page_size=page, num_pages=context // page, max_context=context)
    engine = Engine(model.loaded, shapes)
    ids = np.full((1, context), cfg.pad_token_id, np.int32)  # a chunk is whole pages
    ids[0, :length] = np.random.default_rng(seed).integers(3, cfg.vocab_size, length)
    table = np.arange(context // page, dtype=np.int32)[None]
    one = lambda v, dt: np.array([v], dt)

    def run(mode: str, n: int = length) -> float:
        engine.reset_history(0)
        t0 = time.perf_counter()
        out = engine.prefill_batch(
            one(0, np.int32), ids, one(n, np.int32), one(0, np.int32), table,
            SamplingBatch.broadcast(1), max_logprobs=0,
            decoder_from=one(prefill_split(cfg, n, mode), np.int32),
        )  # fmt: skip
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    # Compile on one page (one program for both modes: the mode is an argument, the trip counts of
    # its page loops are dynamic).
    run("exact", min(length, page))
    times: dict[str, list[float]] = {"exact": [], "ced": []}
    for _ in range(repeats):
        for mode in ("exact", "ced"):
            times[mode].append(run(mode))
    exact, ced = float(np.median(times["exact"])), float(np.median(times["ced"]))
    return {
        "page_size": page,
        "exact_tokens_per_s": length / exact,
        "ced_tokens_per_s": length / ced,
        "speedup": exact / ced,
        "exact_seconds": times["exact"],
        "ced_seconds": times["ced"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk of the quality runs")
    ap.add_argument("--no-speed", action="store_true", help="skip the timing")
    ap.add_argument("--no-quality", action="store_true", help="skip the KL")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page of the timed prefill program")
    args = ap.parse_args(argv)
    model = load(args.model)
    cfg = model.cfg
    report = {
        "model": args.model,
        "sliding_window": cfg.sliding_window,
        "ced_boundary": cfg.ced_boundary,
        "num_layers": cfg.num_layers,
        "load_start": os.getloadavg(),
        "lengths": {},
    }
    for length in args.lengths:
        entry: dict = {}
        if not args.no_quality:
            entry.update(quality(model, length, args.prompts, args.seed, args.chunk))
        if not args.no_speed:
            entry.update(speed(model, length, args.repeats, args.seed, args.page_size))
        report["lengths"][str(length)] = entry
        print(json.dumps({str(length): entry}), file=sys.stderr, flush=True)
    report["load_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
