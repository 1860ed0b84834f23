"""Long context: prefill tokens/s and decode step time against context length (issue 13, point 5).

    python bench/long_context.py [MODEL] [--lengths 4096 32768 131072] [--chunk 4096] [--steps 16]

MODEL is a preset ('tiny', the default) or a checkpoint directory. For each length N, an engine of
one slot whose pages hold N tokens plus the decoded ones (the server's programs,
`ced_jax.engine.Engine`: `prefill_batch` a page of `--page-size` tokens per loop iteration,
`decode` one token) prefills N random token ids in chunks of `--chunk` tokens (as the server does;
one untimed one-page call first compiles the program), then decodes `--steps` tokens greedily after
one untimed step: reports prefill tokens/s, the median decode step time, and each step time's ratio to
the shortest length's. The indexer selects a fixed number of compressed blocks per query, so what
grows with the context in a decode step is the index-key scoring (one dot product per compressed
entry) and the page-table walk; the rest of the step is the same at every length.

Beside each decode step time: `indexer_ms`, the index source layers' scoring of every compressed
entry plus top-k alone at that length (`--indexer-only`: only that, in seconds rather than minutes),
and its multiply-adds: what a step spends on the part that grows with the context.

`--decode-only`: no prefill; the decode steps run at each length on pages never written (a step
does the same work whatever its pages hold), for the step times alone in seconds rather than hours.

`--table-context T`: the slot's pages and page table hold T tokens, as in a server started with
`--max-context T`; prefill runs on the table cut to the server's page-table width for the prompt
(`serving.config.default_context_buckets`: 8192 tokens, x8 from there, then T), and the decode steps
alternate between the whole table of T tokens (what every step read before those widths existed)
and the cut one (what the server runs now): both medians are reported (their tokens are the same).

Also, shape-only (nothing allocated): the engine state of one `--shape-model` (v41-flash) sequence of
`--shape-context` (1M) tokens, `jax.eval_shape` of the buffers the server allocates, by buffer.
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

from ced_jax import cache as cache_lib  # noqa: E402
from ced_jax.api import load  # noqa: E402
from ced_jax.config import preset  # noqa: E402
from ced_jax.engine import Engine, SamplingBatch, StateShapes  # noqa: E402
from serving.config import default_context_buckets  # noqa: E402
from serving.planning.capacity import engine_state, kv_bytes_per_token  # noqa: E402


def one(v, dtype) -> np.ndarray:
    return np.array([v], dtype)


def measure(
    model,
    length: int,
    chunk: int,
    page: int,
    steps: int,
    seed: int,
    table_context: int | None,
    decode_only: bool = False,
) -> dict:
    cfg = model.cfg
    need = -(-(length + steps + 2) // page) * page
    context = need if table_context is None else -(-table_context // page) * page
    if context < need:
        raise SystemExit(f"--table-context {table_context} holds fewer than {need} tokens")
    shapes = StateShapes(max_slots=1, page_size=page, num_pages=context // page, max_context=context)
    engine = Engine(model.loaded, shapes)
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, length).astype(np.int32)
    whole = np.arange(context // page, dtype=np.int32)[None]
    width = next(w for w in default_context_buckets(context, page) if w >= need) // page
    table = whole[:, :width]  # what the server's programs read (== whole without --table-context)
    sampling = SamplingBatch.broadcast(1)

    def prefill(start: int, n: int):
        padded = np.full((1, chunk), cfg.pad_token_id, np.int32)
        padded[0, :n] = ids[start : start + n]
        out = engine.prefill_batch(
            one(0, np.int32), padded, one(n, np.int32), one(start, np.int32), table, sampling, max_logprobs=0
        )
        return out

    engine.reset_history(0)
    if decode_only:  # the pages stay unwritten: a step's work does not depend on what they hold
        prefill_s, token = float("nan"), 3
    else:
        jax.block_until_ready(prefill(0, min(page, length)))  # compile
        engine.reset_history(0)
        t0 = time.perf_counter()
        for start in range(0, length, chunk):
            out = prefill(start, min(chunk, length - start))
            jax.block_until_ready(out)
        prefill_s = time.perf_counter() - t0
        token = int(jax.device_get(out)[0][0])

    tables = {"cut": table} if table_context is None else {"cut": table, "whole": whole}
    times: dict[str, list[float]] = {name: [] for name in tables}
    for i in range(len(tables) * (steps + 1)):
        name = list(tables)[i % len(tables)]
        t0 = time.perf_counter()
        res = engine.decode(
            one(0, np.int32), one(token, np.int32), one(length + i, np.int32), one(1, np.int32),
            tables[name], sampling, max_logprobs=0,
        )  # fmt: skip
        times[name].append(time.perf_counter() - t0)
        token = int(res[0][0])
    decode = {name: t[1:] for name, t in times.items()}  # the first of each compiles
    out = {
        "context_tokens": length,
        "page_size": page,
        "chunk": chunk,
        "table_tokens": width * page,
        "prefill_seconds": prefill_s,
        "prefill_tokens_per_s": length / prefill_s,
        "decode_step_ms_median": 1e3 * float(np.median(decode["cut"])),
        "decode_step_ms": [round(1e3 * t, 3) for t in decode["cut"]],
        "state_bytes": cache_lib.buffer_bytes(engine.state),
    }
    if "whole" in decode:
        out["whole_table_tokens"] = context
        out["whole_table_decode_step_ms_median"] = 1e3 * float(np.median(decode["whole"]))
        out["whole_table_decode_step_ms"] = [round(1e3 * t, 3) for t in decode["whole"]]
    return out


def indexer_only(cfg, length: int, page: int, repeats: int = 9, impl: str = "reference") -> dict:
    """The part of a decode step that grows with the context, alone: each index source layer's
    scoring of every compressed entry (`kernels.index_scores` under `impl`; reference: the FP4 keys
    unpacked through the page table, bf16 dot products; cpu: the packed keys read by the CPU kernel) and
    its top-k, at one query, summed over the layers
    (median ms of `repeats` after one compile). Also the multiply-adds it does (entries x index
    heads x index head dim)."""
    import jax.numpy as jnp

    from ced_jax.model.layers import kernels
    from ced_jax.options import Impl

    key_bytes = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    total_ms, macs = 0.0, 0
    for layer in cfg.index_source_layer_ids:
        entries = length // cfg.compress_ratios[layer]
        pages = -(-entries // page)
        rng = np.random.default_rng(layer)
        keys = rng.integers(0, 256, (pages, page, key_bytes)).astype(np.uint8)
        keys[..., cfg.index_head_dim // 2 :] = 127  # ue8m0 scales of 1.0 (random bytes would be inf/NaN)
        key_pages = jnp.asarray(keys)
        table = jnp.arange(pages, dtype=jnp.int32)[None]
        q = jnp.asarray(rng.standard_normal((1, 1, cfg.index_n_heads, cfg.index_head_dim)), jnp.float32)
        w = jnp.ones((1, 1, cfg.index_n_heads), jnp.float32)
        visible = jnp.full((1, 1), entries, jnp.int32)
        fn = jax.jit(
            lambda q, w, k, t, n: jax.lax.top_k(
                kernels.index_scores(q, w, k, t, n, impl=Impl.parse(impl)), cfg.index_topk
            )
        )
        jax.block_until_ready(fn(q, w, key_pages, table, visible))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, w, key_pages, table, visible))
            times.append(time.perf_counter() - t0)
        total_ms += 1e3 * float(np.median(times))
        macs += entries * cfg.index_n_heads * cfg.index_head_dim
    return {"indexer_ms": total_ms, "indexer_macs": macs}


def shape_only(model_name: str, context: int, page: int) -> dict:
    cfg = preset(model_name)
    state = engine_state(cfg, max_slots=1, page_size=page, max_context=-(-context // page) * page)
    buffers = {
        "compressed_kv_and_index_keys": cache_lib.buffer_bytes((state.kv, state.index_k)),
        "swa_rings": cache_lib.buffer_bytes(state.window),
        "compressor_states": cache_lib.buffer_bytes((state.state_kv, state.state_score)),
    }
    return {
        "model": model_name,
        "context_tokens": context,
        "page_size": page,
        "pages": context // page,
        "kv_bytes_per_token": kv_bytes_per_token(cfg, page),
        "buffers_bytes": buffers,
        "total_bytes": cache_lib.buffer_bytes(state),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="tiny")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--chunk", type=int, default=4096, help="prefill tokens per call (whole pages)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--table-context", type=int, metavar="T",
        help="size the slot's pages and table for T tokens (a server's --max-context) and time decode "
        "on the whole table and on the server's cut one",
    )  # fmt: skip
    ap.add_argument(
        "--decode-only", action="store_true",
        help="no prefill: time decode steps at each length on unwritten pages (the same work per step)",
    )  # fmt: skip
    ap.add_argument("--impl", default="reference", help="ced_jax.options.Impl: reference, cpu, pallas...")
    ap.add_argument("--shape-model", default="v41-flash")
    ap.add_argument("--shape-context", type=int, default=1 << 20)
    ap.add_argument(
        "--indexer-only", action="store_true",
        help="time only the indexer's scoring and top-k at each length (no prefill, no decode)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.chunk % args.page_size:
        ap.error(f"--chunk {args.chunk} is not a multiple of --page-size {args.page_size}")
    report = {"model": args.model, "impl": args.impl, "load_start": os.getloadavg(), "lengths": {}}
    report["shape_only"] = shape_only(args.shape_model, args.shape_context, args.page_size)
    print(json.dumps(report["shape_only"]), file=sys.stderr, flush=True)
    model = load(args.model, impl=args.impl)
    for length in args.lengths:
        if args.indexer_only:
            scan = indexer_only(model.cfg, length, args.page_size, impl=args.impl)
            entry = {"context_tokens": length, **scan}
            report["lengths"][str(length)] = entry
            print(json.dumps(entry), file=sys.stderr, flush=True)
            continue
        entry = measure(
            model,
            length,
            args.chunk,
            args.page_size,
            args.steps,
            args.seed,
            args.table_context,
            args.decode_only,
        )
        entry.update(indexer_only(model.cfg, length, args.page_size, impl=args.impl))
        report["lengths"][str(length)] = entry
        print(json.dumps(entry), file=sys.stderr, flush=True)
    key = "indexer_ms" if args.indexer_only else "decode_step_ms_median"
    base = report["lengths"][str(min(args.lengths))][key]
    for entry in report["lengths"].values():
        entry[f"{key}_ratio_to_shortest"] = entry[key] / base
    report["load_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
