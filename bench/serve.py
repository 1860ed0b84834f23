"""Serving benchmark: concurrent streaming gRPC clients with Poisson arrivals against a local server.

    python bench/serve.py                      # starts `JaxEngine` on the tiny preset in-process
    python bench/serve.py --addr HOST:PORT     # an already running `ced-jax serve`

For each concurrency level C (default 1, 16, 32), `--requests-per-level` x C requests (at least 8)
arrive as a Poisson process of rate `--rate` per second; at most C streams are open at once (the
others wait client-side, as behind a load balancer). Every request streams `--output-len` tokens
(ignore_eos, sampled with its own seed) after a random `--prompt-len`-token prompt.

Reported per level: requests/s and output tokens/s over the level's wall time, TTFT (request sent ->
first token received) and TPOT (time per output token after the first: (last - first) / (n - 1)),
p50 and p99; and the ratio of output tokens/s at each level to the single-stream level. The server's
compiles-after-warm-up counter (from /metrics when in-process) must stay 0. In-process, also the
mean scheduler step (first dispatch to last result) and the mean gap between steps in which the
device waits for the host (`ced_device_idle_between_steps_seconds`), and the gap's share of both.

With the in-process server, the library path is measured too, in the same process after the levels
(`--library-requests`, 0 to skip): `ced_jax.load(model).generate` on prompts and outputs of the same
lengths and sampling, one after another, output tokens over their total time (prefill included, as
a served request's); the single stream's output tokens/s is reported as a ratio to it.

HTTP mode (`--http`, issue 11.9): the overhead of the HTTP + chat layer against gRPC on the same
requests and the same server. The in-process server also listens for HTTP (`ServeConfig.http_port`);
with `--addr`, give `--http-url` (a `ced-jax serve ... --http-port` server) and `--tokenizer`. Each
request is a one-turn non-thinking chat with random text; it goes to `POST /v1/chat/completions`
(`stream: true`, usage included, raw SSE over httpx) as messages, and to gRPC Generate as the token ids
our chat layer renders for those messages (serving.chat: the prompt the HTTP layer builds, checked
against each answer's usage.prompt_tokens), with the same max_tokens, temperature and seed. Neither side
ignores EOS (Chat Completions has no such field), so throughput counts the tokens actually produced
(gRPC: tokens streamed; HTTP: usage.completion_tokens). HTTP TTFT ends at the first chunk with text
(content or reasoning_content), which is what a client sees: a first token the parser holds back (a
leading newline, the start of a possible tool-call marker) counts until it is released. Per level the
two paths run A-B-B-A (gRPC, HTTP, HTTP, gRPC, `--http-repeats` pairs) on the same request set, so a
drift in machine load hits both; the ratios are HTTP / gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving import client  # noqa: E402


async def _one(addr: str, prompt: list[int], output_len: int, seed: int) -> dict:
    sent = time.perf_counter()
    first = last = None
    n = 0
    async for msg in client.astream(
        addr, prompt, max_tokens=output_len, temperature=0.8, seed=seed, ignore_eos=True, timeout=600
    ):
        if msg.token_ids:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            n += len(msg.token_ids)
    return {"ttft": first - sent, "tpot": (last - first) / (n - 1) if n > 1 else float("nan"), "tokens": n}


def _step_sums(server) -> dict | None:
    """The in-process server's step histograms' sums and counts (None: a remote server)."""
    if server is None:
        return None
    get = server.metrics.registry.get_sample_value
    names = ("ced_device_idle_between_steps_seconds", "ced_step_seconds")
    return {f"{n}{k}": get(f"{n}{k}") or 0.0 for n in names for k in ("_sum", "_count")}


def _step_shares(before: dict | None, after: dict | None) -> dict:
    """Per level: mean device step and idle gap between steps (ms), and idle / (idle + step)."""
    if before is None:
        return {}
    d = {k: after[k] - before[k] for k in after}
    idle, steps = d["ced_device_idle_between_steps_seconds_sum"], d["ced_step_seconds_sum"]
    n_idle, n_steps = d["ced_device_idle_between_steps_seconds_count"], d["ced_step_seconds_count"]
    return {
        "step_ms_mean": 1e3 * steps / max(n_steps, 1),
        "idle_between_steps_ms_mean": 1e3 * idle / max(n_idle, 1),
        "idle_share": idle / max(idle + steps, 1e-12),
    }


async def _level(addr: str, concurrency: int, args, rng: np.random.Generator) -> dict:
    n_requests = max(8, args.requests_per_level * concurrency)
    gaps = rng.exponential(1.0 / args.rate, n_requests)
    prompts = [[0] + rng.integers(3, args.vocab, args.prompt_len - 1).tolist() for _ in range(n_requests)]
    seeds = rng.integers(0, 2**31, n_requests)
    gate = asyncio.Semaphore(concurrency)

    async def arrive(i: int, at: float):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        async with gate:
            return await _one(addr, prompts[i], args.output_len, int(seeds[i]))

    t0 = time.perf_counter()
    results = await asyncio.gather(*(arrive(i, float(at)) for i, at in enumerate(np.cumsum(gaps))))
    wall = time.perf_counter() - t0
    ttft = np.array([r["ttft"] for r in results])
    tpot = np.array([r["tpot"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "requests_per_s": n_requests / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "tpot_p50_ms": 1e3 * float(np.nanpercentile(tpot, 50)),
        "tpot_p99_ms": 1e3 * float(np.nanpercentile(tpot, 99)),
    }


def _start_local(args, http: bool = False):
    """An in-process server over JaxEngine on `args.model` (its own event-loop thread)."""
    import threading

    import ced_jax
    from serving.config import ServeConfig
    from serving.engine.jax_engine import JaxEngine, ModelTokenizer
    from serving.server import Server

    model = ced_jax.load(args.model)
    max_slots = max(args.concurrency)
    context = args.max_context
    config = ServeConfig(
        max_slots=max_slots, page_size=args.page_size, max_context=context, prefill_buckets=(args.chunk,),
        prefill_rows=args.prefill_rows, prefill_token_budget=args.prefill_token_budget,
        batch_invariant=args.batch_invariant, overlap_schedule=args.overlap_schedule,
        max_tokens_limit=context, metrics_port=0,
        enable_prefix_cache=False,  # random prompts share nothing but BOS; keep the work honest
    )  # fmt: skip
    if http:
        config = dataclasses.replace(config, http_port=0)
    print(
        f"batch invariant {config.batch_invariant}, overlap {config.overlap_schedule}, "
        f"prefill rows {config.prefill_rows}, "
        f"token budget {config.prefill_token_budget}, "
        f"decode buckets {config.decode_buckets}",
        file=sys.stderr,
    )
    engine = JaxEngine(model, config)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = Server(config)
    t = time.perf_counter()
    asyncio.run_coroutine_threadsafe(server.start(engine, ModelTokenizer(model)), loop).result()
    print(f"engine warm-up (compile) {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return server, loop, model


def _library(model, args, rng: np.random.Generator) -> dict:
    """Output tokens/s of `model.generate` on `--library-requests` prompts like the levels' (after one
    untimed call that compiles)."""
    prompts = [
        [0] + rng.integers(3, args.vocab, args.prompt_len - 1).tolist()
        for _ in range(args.library_requests + 1)
    ]
    kw = dict(max_tokens=args.output_len, temperature=0.8, stop_at_eos=False)
    model.generate(prompts[0], seed=0, **kw)
    tokens, t0 = 0, time.perf_counter()
    for i, prompt in enumerate(prompts[1:]):
        tokens += len(model.generate(prompt, seed=i, **kw)["token_ids"])
    wall = time.perf_counter() - t0
    return {"requests": args.library_requests, "output_tokens_per_s": tokens / wall}


# ---------------------------------------------------------------------------------------------------
# HTTP mode: the same requests through /v1/chat/completions and gRPC


def _chat_requests(args, rng: np.random.Generator, n: int, tokenizer_path) -> list[dict]:
    """`n` one-turn non-thinking chats of random text, with the token ids our chat layer renders."""
    import tokenizers

    from ced_jax.chat import PromptEncoder, render_messages

    hf = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    encoder = PromptEncoder(hf)
    out = []
    for _ in range(n):
        text = hf.decode(rng.integers(3, args.vocab, args.prompt_len).tolist(), skip_special_tokens=True)
        messages = [{"role": "user", "content": text}]
        ids = encoder.encode(render_messages(messages, thinking_mode="chat"))
        out.append({"messages": messages, "ids": ids, "seed": int(rng.integers(0, 2**31))})
    return out


async def _one_grpc(addr: str, req: dict, args) -> dict:
    sent = time.perf_counter()
    first = None
    n = 0
    async for msg in client.astream(
        addr, req["ids"], max_tokens=args.output_len, temperature=0.8, seed=req["seed"], timeout=600,
        api_key=args.api_key,
    ):  # fmt: skip
        if msg.token_ids:
            now = time.perf_counter()
            first = now if first is None else first
            n += len(msg.token_ids)
    end = time.perf_counter()
    first = end if first is None else first
    return {"ttft": first - sent, "tokens": n, "end": end, "prompt_ok": True}


async def _one_http(http, url: str, req: dict, args) -> dict:
    body = {
        "model": "deepseek-flash",
        "messages": req["messages"],
        "thinking": {"type": "disabled"},
        "max_tokens": args.output_len,
        "temperature": 0.8,
        "seed": req["seed"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sent = time.perf_counter()
    first = None
    usage = None
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            if first is None and any(
                (c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("reasoning_content")
                for c in chunk.get("choices") or ()
            ):
                first = time.perf_counter()
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    return {
        "ttft": (end if first is None else first) - sent,
        "tokens": int(usage["completion_tokens"]),
        "end": end,
        "prompt_ok": int(usage["prompt_tokens"]) == len(req["ids"]),
        "no_text": first is None,
    }


async def _run_path(path: str, reqs: list[dict], gaps: np.ndarray, concurrency: int, args) -> dict:
    import httpx2 as httpx  # the openai SDK's HTTP client (installed with it)

    gate = asyncio.Semaphore(concurrency)
    url = args.http_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:

        async def arrive(i: int, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with gate:
                if path == "grpc":
                    return await _one_grpc(args.addr, reqs[i], args)
                return await _one_http(http, url, reqs[i], args)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(arrive(i, float(at)) for i, at in enumerate(np.cumsum(gaps))))
    return {"wall": max(r["end"] for r in results) - t0, "results": results}


def _http_levels(args, rng: np.random.Generator, tokenizer_path) -> list[dict]:
    levels = []
    warm = _chat_requests(args, rng, 1, tokenizer_path)
    for path in ("grpc", "http"):  # first requests of each path, untimed
        asyncio.run(_run_path(path, warm, np.zeros(1), 1, args))
    for c in args.concurrency:
        n = max(8, args.requests_per_level * c)
        reqs = _chat_requests(args, rng, n, tokenizer_path)
        gaps = rng.exponential(1.0 / args.rate, n)
        runs = {"grpc": [], "http": []}
        for _ in range(args.http_repeats):
            for path in ("grpc", "http", "http", "grpc"):  # A-B-B-A: load drift hits both paths alike
                runs[path].append(asyncio.run(_run_path(path, reqs, gaps, c, args)))
        level = {
            "concurrency": c,
            "requests": n,
            "prompt_tokens_mean": float(np.mean([len(r["ids"]) for r in reqs])),
        }
        for path, rs in runs.items():
            results = [r for run in rs for r in run["results"]]
            ttft = np.array([r["ttft"] for r in results])
            level[path] = {
                "output_tokens_per_s": sum(r["tokens"] for r in results) / sum(run["wall"] for run in rs),
                "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
                "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
                "output_tokens_mean": float(np.mean([r["tokens"] for r in results])),
            }
        http = level["http"]
        http["prompt_mismatches"] = sum(not r["prompt_ok"] for run in runs["http"] for r in run["results"])
        http["answers_without_text"] = sum(r["no_text"] for run in runs["http"] for r in run["results"])
        level["ratio"] = {
            k: http[k] / level["grpc"][k] for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")
        }
        levels.append(level)
    return levels


def _print_http(levels: list[dict], args, machine: str) -> None:
    print(
        f"# bench/serve.py --http on {machine}; non-thinking chat, ~{args.prompt_len} random-text tokens, "
        f"max_tokens {args.output_len}, Poisson rate {args.rate}/s, {args.http_repeats} A-B-B-A rounds"
    )
    print(
        "| C | requests x runs | prompt tok | out tok/req gRPC / HTTP | out tok/s gRPC / HTTP (ratio) "
        "| TTFT p50 ms gRPC / HTTP (ratio) | TTFT p99 ms gRPC / HTTP (ratio) |"
    )
    print("|---|---|---|---|---|---|---|")
    for lv in levels:
        g, h, r = lv["grpc"], lv["http"], lv["ratio"]
        print(
            f"| {lv['concurrency']} | {lv['requests']} x {2 * args.http_repeats} | "
            f"{lv['prompt_tokens_mean']:.0f} | "
            f"{g['output_tokens_mean']:.1f} / {h['output_tokens_mean']:.1f} | "
            f"{g['output_tokens_per_s']:.1f} / {h['output_tokens_per_s']:.1f} "
            f"({r['output_tokens_per_s']:.2f}) | "
            f"{g['ttft_p50_ms']:.0f} / {h['ttft_p50_ms']:.0f} ({r['ttft_p50_ms']:.2f}) | "
            f"{g['ttft_p99_ms']:.0f} / {h['ttft_p99_ms']:.0f} ({r['ttft_p99_ms']:.2f}) |"
        )
    bad = sum(lv["http"]["prompt_mismatches"] for lv in levels)
    empty = sum(lv["http"]["answers_without_text"] for lv in levels)
    print(
        f"# HTTP prompts whose usage.prompt_tokens differed from the gRPC prompt: {bad}; "
        f"answers with no text: {empty}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", help="benchmark this server instead of starting one")
    p.add_argument("--model", default="tiny", help="model for the in-process server")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 32])
    p.add_argument("--requests-per-level", type=int, default=3, help="requests per level = this x C")
    p.add_argument("--rate", type=float, default=50.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=None, help="token id range (default: the model's)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk of the in-process engine")
    p.add_argument(
        "--prefill-rows",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="prefill row counts of the in-process engine, e.g. 4 or 1,2,4 (default: ServeConfig's)",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=None,
        help="prompt tokens per step (default: ServeConfig's)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the in-process engine's ServeConfig.batch_invariant (default: on, as `ced-jax serve`)",
    )
    p.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the in-process engine's ServeConfig.overlap_schedule (default: on, as `ced-jax serve`)",
    )
    p.add_argument("--library-requests", type=int, default=8, help="generate() calls timed (0: skip)")
    p.add_argument("--max-context", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    g = p.add_argument_group("HTTP mode (the HTTP + chat layer against gRPC on the same requests)")
    g.add_argument("--http", action="store_true", help="compare /v1/chat/completions with gRPC")
    g.add_argument("--http-url", help="with --addr: the same server's HTTP API, e.g. http://127.0.0.1:8000")
    g.add_argument("--tokenizer", help="with --addr: the model's tokenizer.json (to render the gRPC prompts)")
    g.add_argument("--http-repeats", type=int, default=1, help="A-B-B-A rounds per level")
    g.add_argument("--api-key", help="API key of a server started with keys")
    args = p.parse_args(argv)
    if args.http:
        return _main_http(args)
    if args.concurrency[0] != 1:
        raise SystemExit("--concurrency must start with 1 (the ratios are to a single stream)")
    server = loop = model = None
    if args.addr is None:
        server, loop, model = _start_local(args)
        args.addr = server.address
        args.vocab = args.vocab or model.cfg.vocab_size
    elif args.vocab is None:
        args.vocab = client.model_info(args.addr).vocab_size
    rng = np.random.default_rng(args.seed)
    asyncio.run(_level(args.addr, 1, argparse.Namespace(**{**vars(args), "requests_per_level": 1}), rng))
    levels = []
    for c in args.concurrency:
        before = _step_sums(server)
        levels.append(asyncio.run(_level(args.addr, c, args, rng)))
        levels[-1].update(_step_shares(before, _step_sums(server)))
    base = levels[0]["output_tokens_per_s"]
    for lv in levels:
        lv["ratio_to_single"] = lv["output_tokens_per_s"] / base
    compiles = None
    library = None
    if server is not None:
        compiles = server.engine.compiles_after_warmup
        asyncio.run_coroutine_threadsafe(server.shutdown(0.0), loop).result()
        if args.library_requests > 0:
            library = _library(model, args, rng)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    print(f"# bench/serve.py on {machine}; prompt {args.prompt_len}, output {args.output_len} tokens, "
          f"Poisson rate {args.rate}/s; compiles after warm-up: {compiles}")  # fmt: skip
    if server is not None:
        cfg = server.config
        print(f"# prefill rows {cfg.prefill_rows}, token budget {cfg.prefill_token_budget}, "
              f"chunk {args.chunk}, decode buckets {cfg.decode_buckets}")  # fmt: skip
    print(
        "| C | requests | req/s | out tok/s | ratio to C=1 | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| step / idle between steps ms (idle share) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for lv in levels:
        idle = (
            f"{lv['step_ms_mean']:.1f} / {lv['idle_between_steps_ms_mean']:.1f} ({lv['idle_share']:.0%})"
            if "idle_share" in lv
            else "-"
        )
        print(
            f"| {lv['concurrency']} | {lv['requests']} | {lv['requests_per_s']:.2f} | "
            f"{lv['output_tokens_per_s']:.1f} | {lv['ratio_to_single']:.2f} | "
            f"{lv['ttft_p50_ms']:.0f} / {lv['ttft_p99_ms']:.0f} | "
            f"{lv['tpot_p50_ms']:.1f} / {lv['tpot_p99_ms']:.1f} | {idle} |"
        )
    if library is not None:
        ratio = levels[0]["output_tokens_per_s"] / library["output_tokens_per_s"]
        print(
            f"library path (generate, {library['requests']} requests): "
            f"{library['output_tokens_per_s']:.1f} output tok/s; one stream / library = {ratio:.2f}"
        )
    if args.json:
        result = {"levels": levels, "compiles_after_warmup": compiles, "library": library}
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if not compiles else 1


def _main_http(args) -> int:
    server = loop = None
    if args.addr is None:
        server, loop, model = _start_local(args, http=True)
        args.addr = server.address
        args.http_url = f"http://127.0.0.1:{server.http_port}"
        args.vocab = args.vocab or model.cfg.vocab_size
        tokenizer_path = model.tokenizer_path
    else:
        if not (args.http_url and args.tokenizer):
            raise SystemExit("--http with --addr needs --http-url and --tokenizer")
        tokenizer_path = args.tokenizer
        args.vocab = args.vocab or client.model_info(args.addr, api_key=args.api_key).vocab_size
    rng = np.random.default_rng(args.seed)
    try:
        levels = _http_levels(args, rng, tokenizer_path)
    finally:
        compiles = server.engine.compiles_after_warmup if server is not None else None
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.shutdown(0.0), loop).result()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    _print_http(levels, args, machine)
    print(f"# compiles after warm-up: {compiles}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"http_levels": levels, "compiles_after_warmup": compiles}, indent=2)
        )
    return 0 if not compiles else 1


if __name__ == "__main__":
    sys.exit(main())
