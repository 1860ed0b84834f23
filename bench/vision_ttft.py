"""Time to first token of an image question over gRPC: cold, with the feature cache warm, and with
the feature cache and the prefix cache warm (issue 14.6).

    python bench/vision_ttft.py [--model tests/golden/tiny-v] [--repeats 7] [--json]

An in-process server (`serving.server.Server` over `JaxEngine`, prefix cache on) on a checkpoint with
a vision tower; one request at a time, greedy, 4 output tokens; TTFT = request sent -> first token
received, so it includes pre-processing, the ViT + aligner (when it runs), the prefill and the first
sample. Per repeat, three requests on a picture the server has not seen before (the fixture's
image1.png with one pixel changed per repeat, so each repeat's content hash is new):
- cold: the picture first, then a question (feature cache miss, nothing cached);
- feature cache warm: the same picture with a new question put BEFORE it (the ViT is skipped; the
  prompt's pages differ from the first block on, so the prefix cache has nothing);
- feature + prefix cache warm: the same picture first, then another new question (the ViT is
  skipped and the pages up to the question come from the prefix cache).
The order is fixed (a warm request needs the cold one before it); medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from PIL import Image  # noqa: E402

from serving import client  # noqa: E402

PLACEHOLDER = client.IMAGE_PLACEHOLDER


def _picture(base: Image.Image, k: int) -> bytes:
    image = base.copy()
    image.putpixel((k % image.width, 0), (k * 37 % 256, k * 91 % 256, 255 - k % 256))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _prompt(before: str, after: str) -> str:
    return f"<｜User｜>{before}{PLACEHOLDER}{after}<｜Assistant｜></think>"


async def _ttft(addr: str, text: str, image: bytes) -> tuple[float, int]:
    sent = time.perf_counter()
    first = None
    cached = 0
    async for msg in client.astream(addr, text, images=[image], max_tokens=4, temperature=0.0, timeout=600):
        if first is None and msg.token_ids:
            first = time.perf_counter() - sent
        if msg.HasField("usage"):
            cached = msg.usage.cached_prompt_tokens
    return first, cached


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "tests" / "golden" / "tiny-v"))
    ap.add_argument("--image", default=str(REPO / "tests" / "golden" / "tiny-v" / "image1.png"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import ced_jax
    from serving.config import ServeConfig
    from serving.engine.jax_engine import JaxEngine, ModelTokenizer
    from serving.server import Server

    model = ced_jax.load(args.model)
    if model.vision is None:
        ap.error(f"{args.model}: the model has no vision tower")
    config = ServeConfig(
        max_slots=4, page_size=16, max_context=1024, prefill_buckets=(128,), max_tokens_limit=64, default_max_tokens=16,
        metrics_port=None, port=0,
    )  # fmt: skip
    engine = JaxEngine(model, config)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = Server(config)
    t = time.perf_counter()
    asyncio.run_coroutine_threadsafe(server.start(engine, ModelTokenizer(model)), loop).result()
    warm_s = time.perf_counter() - t
    addr = f"127.0.0.1:{server.port}"
    base = Image.open(args.image).convert("RGB")
    run = lambda text, image: asyncio.run(_ttft(addr, text, image))
    run(_prompt("", "Warm-up question?"), _picture(base, 10_000))  # first-request effects out
    rows = {"cold": [], "feature cache warm": [], "feature + prefix cache warm": []}
    cached = {k: [] for k in rows}
    for k in range(args.repeats):
        image = _picture(base, k)
        for name, text in (
            ("cold", _prompt("", f"What is in picture {k}?")),
            ("feature cache warm", _prompt(f"Question {k}: how many colours are in", " ?")),
            ("feature + prefix cache warm", _prompt("", f"Describe picture {k} in one word.")),
        ):
            ttft, hit = run(text, image)
            rows[name].append(ttft)
            cached[name].append(hit)
    pipeline = server.images
    out = {
        "model": args.model,
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={len(__import__('os').sched_getaffinity(0))}",
        "warmup_s": round(warm_s, 1),
        "repeats": args.repeats,
        "ttft_median_s": {k: round(statistics.median(v), 4) for k, v in rows.items()},
        "ttft_min_s": {k: round(min(v), 4) for k, v in rows.items()},
        "cached_prompt_tokens": {k: sorted(set(v)) for k, v in cached.items()},
        "vit_runs": getattr(pipeline, "vit_runs", None),
        "feature_cache_hits": getattr(pipeline, "cache_hits", None),
    }
    cold = out["ttft_median_s"]["cold"]
    out["ratio_to_cold"] = {k: round(v / cold, 3) for k, v in out["ttft_median_s"].items()}
    asyncio.run_coroutine_threadsafe(server.shutdown(0), loop).result()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k in rows:
            print(f"{k:30s} TTFT median {out['ttft_median_s'][k] * 1e3:8.1f} ms  "
                  f"(x{out['ratio_to_cold'][k]:.2f} of cold)  cached tokens {out['cached_prompt_tokens'][k]}")
        print(f"ViT runs {out['vit_runs']}, feature-cache hits {out['feature_cache_hits']}, warm-up {warm_s:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
