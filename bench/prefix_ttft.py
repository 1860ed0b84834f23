"""Time to first token of a long prompt whose prefix is cached on the device, in host memory or on
disk, against the same prompt cold (issue 13, point 6), and the bytes each tier keeps per cached token.

    python bench/prefix_ttft.py [MODEL] [--prompt 16384] [--shared 0.9] [--repeats 3] [--chunk 512]

MODEL is a preset ('tiny', the default) or a checkpoint directory. The server's scheduler and engine
(`serving.scheduling.scheduler.Scheduler` over `serving.engine.jax_engine.JaxEngine`, driven step by step
on this
thread, no network) serve, per repeat, fresh random prompts of `--prompt` tokens:
- cold: a prompt A nothing is cached for;
- device: a prompt B sharing A's first `--shared` fraction (page aligned), A's blocks on the device;
- host: a prompt C sharing the same prefix after `Scheduler.offload_prefix_cache` moved every cached
  block to the host tier (the prefix comes back from host memory);
- disk: the same on a second scheduler over the same engine whose host tier holds nothing (every
  offloaded block goes to disk, written before the request arrives).
TTFT is the wall time from `submit` to the first token's event; reports medians, their ratio to
cold, the cached tokens of each hit, and per tier the bytes kept per cached token (host: the blobs;
disk: the files, header included) against the device's KV bytes per token.
The machine is shared: the load average at the start and the end is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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


def ttft(sched: Scheduler, rid: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one request, run to its end."""
    events, first = [], []
    t0 = time.perf_counter()

    def sink(ev):
        if ev.token_ids and not first:
            first.append(time.perf_counter() - t0)
        events.append(ev)

    req = GenerationRequest(
        request_id=rid, prompt_token_ids=tuple(prompt), max_tokens=2,
        sampling=SamplingParams(temperature=0.0), ignore_eos=True,
    )  # fmt: skip
    sched.submit(req, sink)
    while sched.step():
        pass
    last = events[-1]
    if last.usage is None or not first:
        raise RuntimeError(f"{rid}: no first token ({last})")
    return first[0], last.usage.cached_prompt_tokens


def tier_bytes(sched: Scheduler, page_size: int) -> dict:
    g = sched.tiers.gauges()
    out = {}
    for tier in ("host", "disk"):
        pages, nbytes = g[f"{tier}_pages"], g[f"{tier}_bytes"]
        if pages:
            out[tier] = {"pages": pages, "bytes": nbytes, "bytes_per_token": nbytes / (pages * page_size)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="tiny")
    ap.add_argument("--prompt", type=int, default=16384, help="prompt tokens")
    ap.add_argument("--shared", type=float, default=0.9, help="fraction of the prompt the hits share")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens, whole pages)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 0.0 < args.shared < 1.0:
        ap.error(f"--shared must be in (0, 1), got {args.shared}")
    ps = args.page_size
    context = -(-(args.prompt + 2 * ps) // ps) * ps
    model = load(args.model)
    cfg = model.cfg
    shapes = dict(
        max_slots=1, page_size=ps, max_context=context, num_pages=3 * (context // ps),
        prefill_buckets=(args.chunk,), prefill_rows=(1,), prefill_token_budget=args.chunk,
        max_tokens_limit=2, default_max_tokens=2, metrics_port=None,
    )  # fmt: skip
    disk_dir = tempfile.mkdtemp(prefix="ced-kv-bench-")
    host_cfg = ServeConfig(**shapes, kv_host_bytes=1 << 40)
    disk_cfg = ServeConfig(**shapes, kv_host_bytes=0, kv_disk_dir=disk_dir, kv_disk_bytes=1 << 40)
    load_start = os.getloadavg()
    engine = JaxEngine(model, host_cfg)
    engine.warmup()
    tokenizer = ModelTokenizer(model)
    shared = int(args.prompt * args.shared) // ps * ps
    rng = np.random.default_rng(args.seed)

    def prompt_with(prefix):
        return prefix + rng.integers(3, cfg.vocab_size, args.prompt - len(prefix)).tolist()

    rows = {k: [] for k in ("cold", "device", "host", "disk")}
    cached = {k: [] for k in rows}
    sizes = {}
    for r in range(args.repeats):
        prefix = [cfg.bos_token_id] + rng.integers(3, cfg.vocab_size, shared - 1).tolist()
        sched = Scheduler(engine, tokenizer, host_cfg)
        for name in ("cold", "device"):
            t, c = ttft(sched, f"{name}-{r}", prompt_with(prefix))
            rows[name].append(t)
            cached[name].append(c)
        sched.offload_prefix_cache()
        t, c = ttft(sched, f"host-{r}", prompt_with(prefix))
        rows["host"].append(t)
        cached["host"].append(c)
        sizes["host"] = tier_bytes(sched, ps).get("host")
        sched.close_tiers()
        for f in os.listdir(disk_dir):  # each repeat's disk tier starts empty
            os.unlink(os.path.join(disk_dir, f))
        sched = Scheduler(engine, tokenizer, disk_cfg)
        ttft(sched, f"fill-{r}", prompt_with(prefix))  # the prefix on the device again
        sched.offload_prefix_cache()
        sched.tiers.flush()  # on disk before the request arrives
        sizes["disk"] = tier_bytes(sched, ps).get("disk")
        t, c = ttft(sched, f"disk-{r}", prompt_with(prefix))
        rows["disk"].append(t)
        cached["disk"].append(c)
        sched.close_tiers()
    cold = float(np.median(rows["cold"]))
    result = {
        "model": args.model,
        "prompt_tokens": args.prompt,
        "shared_tokens": shared,
        "page_size": ps,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "device_kv_bytes_per_token": engine.kv_bytes_per_token,
        "ttft_s": {k: float(np.median(v)) for k, v in rows.items()},
        "ttft_s_all": rows,
        "ratio_to_cold": {k: float(np.median(v)) / cold for k, v in rows.items()},
        "cached_prompt_tokens": cached,
        "tier_bytes": sizes,
        "compiles_after_warmup": engine.compiles_after_warmup,
        "load_average": {"start": load_start, "end": os.getloadavg()},
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
