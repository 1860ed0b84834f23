"""One long prompt served with `ced-jax serve`'s default scheduling, against the library path.

    python bench/long_prompt.py [MODEL] [--prompt 8192] [--max-context 65536] [--repeats 1]
                                [serve shapes: --max-slots --prefill-chunk --prefill-rows ...
                                 --long-prefill-chunk (0: the page program only) --long-prefill-step]

The server's scheduler and engine (`Scheduler` over `JaxEngine`, stepped on this thread, no network)
with `ServeConfig`'s defaults except the flags given (as `ced-jax serve MODEL --max-context N` runs),
serve one random prompt of `--prompt` tokens alone: time to its first token and the prompt tokens
per second that makes, with the number of scheduler steps it took. Then, in the same process, the
library path prefills the same prompt (`Model.generate(prompt, 1)`, its default prefill chunk) and
the ratio server / library is reported. Medians over `--repeats` fresh prompts; the load average
at the start and the end, since the machine is shared.
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

from ced_jax.api import load  # noqa: E402
from serving.config import ServeConfig  # noqa: E402
from serving.engine.jax_engine import JaxEngine, ModelTokenizer  # noqa: E402
from serving.engine.protocol import SamplingParams  # noqa: E402
from serving.requests import GenerationRequest  # noqa: E402
from serving.scheduling.scheduler import Scheduler  # noqa: E402


def served_ttft(sched: Scheduler, rid: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, scheduler steps until then) of one request, run to its end."""
    first = []
    t0 = time.perf_counter()

    def sink(ev):
        if ev.token_ids and not first:
            first.append(time.perf_counter() - t0)

    req = GenerationRequest(
        request_id=rid, prompt_token_ids=tuple(prompt), max_tokens=1,
        sampling=SamplingParams(temperature=0.0), ignore_eos=True,
    )  # fmt: skip
    sched.submit(req, sink)
    steps = 0
    while not first and sched.step():
        steps += 1
    while sched.step():
        pass
    if not first:
        raise RuntimeError(f"{rid}: no first token")
    return first[0], steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="tiny")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--max-slots", type=int, help="default: ServeConfig's")
    ap.add_argument("--prefill-chunk", type=int, help="default: ServeConfig's")
    ap.add_argument("--prefill-rows", type=lambda s: tuple(int(x) for x in s.split(",")))
    ap.add_argument("--prefill-token-budget", type=int)
    ap.add_argument("--long-prefill-chunk", type=int, help="default: ServeConfig's (0: off)")
    ap.add_argument("--long-prefill-step", type=int, help="default: ServeConfig's")
    ap.add_argument("--no-batch-invariant", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.prompt + 1 > args.max_context:
        ap.error(f"--prompt {args.prompt} must leave a token of --max-context {args.max_context}")
    given = {
        "max_slots": args.max_slots,
        "prefill_buckets": None if args.prefill_chunk is None else (args.prefill_chunk,),
        "prefill_rows": args.prefill_rows,
        "prefill_token_budget": args.prefill_token_budget,
        "long_prefill_chunk": args.long_prefill_chunk,
        "long_prefill_step": args.long_prefill_step,
    }
    config = ServeConfig(
        max_context=args.max_context,
        batch_invariant=not args.no_batch_invariant,
        metrics_port=None,
        **{k: v for k, v in given.items() if v is not None},
    )
    load_start = os.getloadavg()
    model = load(args.model)
    cfg = model.cfg
    t0 = time.perf_counter()
    engine = JaxEngine(model, config)
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    sched = Scheduler(engine, ModelTokenizer(model), config)
    rng = np.random.default_rng(args.seed)
    prompts = [
        [cfg.bos_token_id] + rng.integers(3, cfg.vocab_size, args.prompt - 1).tolist()
        for _ in range(args.repeats)
    ]
    served, steps = [], []
    for i, prompt in enumerate(prompts):
        t, n = served_ttft(sched, f"long-{i}", prompt)
        served.append(t)
        steps.append(n)
    model.generate(prompts[0], 1)  # the library's programs for this length compiled before it is timed
    library = []
    for prompt in prompts:
        t = time.perf_counter()
        model.generate(prompt, 1)
        library.append(time.perf_counter() - t)
    served_s, library_s = float(np.median(served)), float(np.median(library))
    result = {
        "model": args.model,
        "prompt_tokens": args.prompt,
        "config": {
            "max_context": config.max_context,
            "max_slots": config.max_slots,
            "prefill_chunk": max(config.prefill_buckets),
            "prefill_rows": config.prefill_rows,
            "prefill_token_budget": config.prefill_token_budget,
            "batch_invariant": config.batch_invariant,
            "long_prefill_chunk": config.long_prefill_chunk,
            "long_prefill_step": config.long_prefill_step,
        },
        "engine_warmup_s": round(warmup_s, 1),
        "served_ttft_s": served_s,
        "served_steps": steps,
        "long_prefill_calls": engine.long_prefill_calls,
        "served_prompt_tok_per_s": args.prompt / served_s,
        "library_s": library_s,
        "library_prompt_tok_per_s": args.prompt / library_s,
        "served_over_library": library_s / served_s,
        "compiles_after_warmup": engine.compiles_after_warmup,
        "load_average": {"start": load_start, "end": os.getloadavg()},
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
