"""DSpark speculative decoding against plain decoding, on one model, in one run.

    python bench/dspark.py MODEL [--batch 1 32] [--dspark 4] [--prompt-tokens 32] [--steps 24]
                                 [--repeats 3] [--json]

MODEL is a preset ('tiny': its shipped trained draft, `ced_jax/assets/tiny/dspark.safetensors`) or a
checkpoint directory with mtp.* stages. For each batch size B, on engines of B slots (the server's
programs: `Engine.decode` one token per row, `Engine.speculative_decode` verifying up to K drafts per
row), greedy, the same B prompts (random ids, seed 0):
- plain: median time of one decode step over `steps` steps -> tokens/s = B / step time;
- dspark: `steps` speculative steps (the first, with no drafts yet, untimed) -> median step time,
  output tokens per target step per row (mean of accepted + 1), tokens/s = emitted tokens / time;
- the break-even accepted length: a speculative step costs `ratio` = t_spec / t_plain plain steps, so
  it pays off when the mean accepted length exceeds ratio - 1;
- agreement: whether every row's speculative greedy tokens equal its plain greedy tokens.
Each (program, shape) runs once before it is timed (compile time excluded); `repeats` alternating
rounds of plain and dspark, medians over all timed steps, the load average printed (shared machine).
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

from ced_jax import cache as cache_lib  # noqa: E402
from ced_jax.api import load  # noqa: E402
from ced_jax.api.session import session_page_size  # noqa: E402
from ced_jax.engine import Engine, SamplingBatch, StateShapes  # noqa: E402
from ced_jax.model.dspark import confident_prefix  # noqa: E402


def _engine(model, batch: int, context: int, with_draft: bool):
    page = session_page_size(model.cfg)
    context = -(-context // page) * page
    shapes = StateShapes(
        max_slots=batch, page_size=page, num_pages=batch * context // page, max_context=context
    )
    return Engine(model.loaded, shapes, with_draft=with_draft), cache_lib.contiguous_page_tables(
        batch, shapes.pages_per_slot
    )


def _prefill(engine, tables, prompts: np.ndarray) -> np.ndarray:
    b, n = prompts.shape
    logits, _ = engine.step(
        prompts, np.zeros(b, np.int32), np.full(b, n, np.int32), np.arange(b, dtype=np.int32), tables
    )
    return np.asarray(logits)[:, -1].argmax(-1).astype(np.int32)


def run_plain(model, prompts: np.ndarray, steps: int):
    b, n = prompts.shape
    engine, tables = _engine(model, b, n + steps + 8, with_draft=False)
    token = _prefill(engine, tables, prompts)
    out = [token]
    slots, active = np.arange(b, dtype=np.int32), np.ones(b, bool)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        tok, *_ = engine.decode(
            slots,
            out[-1],
            np.full(b, n + i, np.int32),
            active,
            tables,
            SamplingBatch.broadcast(b),
            max_logprobs=0,
        )
        if i > 0:  # the first call compiles
            times.append(time.perf_counter() - t0)
        out.append(np.asarray(tok, np.int32))
    return np.stack(out, 1), times


def run_dspark(model, prompts: np.ndarray, steps: int, k: int, confidence: float | None = None):
    """`steps` speculative steps with up to k drafts per row; with `confidence` T each row verifies
    `confident_prefix` of its drafts and the step runs the narrowest width that holds them all."""
    b, n = prompts.shape
    engine, tables = _engine(model, b, n + steps * (k + 1) + 8, with_draft=True)
    token = _prefill(engine, tables, prompts)
    out = [[int(t)] for t in token]
    positions = np.full(b, n, np.int32)
    slots, active = np.arange(b, dtype=np.int32), np.ones(b, bool)
    drafts, n_drafts = np.zeros((b, k), np.int32), np.zeros(b, np.int32)
    times, emitted, accepted_total, proposed = [], 0, 0, 0
    for i in range(steps):
        last = np.array([row[-1] for row in out], np.int32)
        width = max(1, int(n_drafts.max()))
        t0 = time.perf_counter()
        step = engine.speculative_decode(
            slots,
            last,
            drafts[:, :width],
            n_drafts,
            positions,
            active,
            tables,
            SamplingBatch.broadcast(b),
            max_logprobs=0,
        )
        elapsed = time.perf_counter() - t0
        if i > 0:  # the first call compiles and has no drafts
            times.append(elapsed)
            emitted += int(np.sum(step.accepted + 1))
            accepted_total += int(np.sum(step.accepted))
            proposed += int(np.sum(n_drafts))
        for r in range(b):
            out[r].extend(int(t) for t in step.tokens[r, : step.accepted[r] + 1])
        positions = positions + step.accepted + 1
        drafts = step.next_drafts[:, :k].astype(np.int32)
        if confidence is None:
            n_drafts = np.full(b, k, np.int32)
        else:
            n_drafts = np.minimum(confident_prefix(step.next_confidence[:, :k], confidence), k)
    return out, times, emitted, accepted_total, proposed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dspark", type=int, default=4, metavar="K")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--confidence",
        type=float,
        nargs="*",
        default=[],
        metavar="T",
        help="also run with the confidence head choosing each row's drafts (threshold T; see README)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = load(args.model)
    if not getattr(model, "dspark", False):
        raise SystemExit(f"{args.model}: no DSpark stages loaded")
    load_start = os.getloadavg()
    rng = np.random.default_rng(0)
    results = []
    for b in args.batch:
        prompts = rng.integers(10, model.cfg.vocab_size - 10, size=(b, args.prompt_tokens)).astype(np.int32)
        variants = [None, *args.confidence]
        plain_times, spec = (
            [],
            {v: dict(times=[], emitted=0, accepted=0, proposed=0, agree=True) for v in variants},
        )
        for _ in range(args.repeats):
            plain_tokens, t_plain = run_plain(model, prompts, args.steps)
            plain_times += t_plain
            for v in variants:
                spec_tokens, t_spec, e, a, p = run_dspark(model, prompts, args.steps, args.dspark, v)
                s = spec[v]
                s["times"] += t_spec
                s["emitted"] += e
                s["accepted"] += a
                s["proposed"] += p
                for r in range(b):
                    m = min(len(spec_tokens[r]), plain_tokens.shape[1])
                    s["agree"] &= spec_tokens[r][:m] == plain_tokens[r, :m].tolist()
        t_plain = float(np.median(plain_times))
        for v in variants:
            s = spec[v]
            t_spec = float(np.median(s["times"]))
            per_step = s["emitted"] / (len(s["times"]) * b)
            ratio = t_spec / t_plain
            results.append(
                {
                    "batch": b,
                    "confidence_threshold": v,
                    "plain_step_s": t_plain,
                    "plain_tokens_per_s": b / t_plain,
                    "dspark_step_s": t_spec,
                    "dspark_tokens_per_s": per_step * b / t_spec,
                    "output_tokens_per_target_step": per_step,
                    "mean_accepted_length": s["accepted"] / (len(s["times"]) * b),
                    "draft_acceptance_rate": s["accepted"] / max(s["proposed"], 1),
                    "speedup": (per_step * b / t_spec) / (b / t_plain),
                    "spec_step_cost_in_plain_steps": ratio,
                    "break_even_accepted_length": ratio - 1,
                    "greedy_tokens_agree": bool(s["agree"]),
                }
            )
    report = {
        "model": args.model,
        "dspark": args.dspark,
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, jax on CPU",
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            print(
                f"batch {r['batch']:>3} conf {r['confidence_threshold']}: "
                f"plain {r['plain_tokens_per_s']:8.1f} tok/s | dspark "
                f"{r['dspark_tokens_per_s']:8.1f} tok/s ({r['speedup']:.2f}x), "
                f"{r['output_tokens_per_target_step']:.2f} tokens/step, accepted "
                f"{r['mean_accepted_length']:.2f}, break-even {r['break_even_accepted_length']:.2f}, "
                f"agree {r['greedy_tokens_agree']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
