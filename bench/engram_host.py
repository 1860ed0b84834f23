"""Engram off device: the host cost of a decode step's Engram gather (issue 12, point 1).

    python bench/engram_host.py [--gib 2] [--dir DIR] [--batches 1,8,32,128] [--steps 50] [--tiny]

With the Engram placement `host` every decode step gathers, per sequence, n_engram_layers x C table
rows (FP8, ehd bytes) and their ue8m0 scales (ehd / 32 bytes) on the host
(`ced_jax.engram_store.EngramStore.gather`) and ships them with the step's inputs. For v41-flash
(2 Engram layers, C = 24, ehd = 256) that is 48 rows x 264 bytes = 12,672 bytes per token.

What is measured (all through `EngramStore.open_raw` + `gather`, the engine's code path):
- `real`: raw files in `convert_weights`' format with v41-flash's row width and Engram config but
  `--gib` GiB of random rows in all (the release's 197 GB does not fit this machine's disk), ids
  uniform over the rows (as the hash spreads them). "cold": the files' pages dropped from the page
  cache (posix_fadvise DONTNEED) before every step, so each row is a read from disk; "warm": the
  same ids again right after, from the page cache.
- `sparse`: sparse files of the release's full size (2 x 384M rows, 203 GB apparent, no data on
  disk): the same gather on tables of the real extent. Reading a hole maps the kernel's zero page
  without disk I/O, so this times the page-fault path over the full address range, not a disk read.
- `--no-madvise`: the same without MADV_RANDOM on the mapping (the kernel's read-ahead around each
  fault), to show why the store asks for it.
- `--tiny`: decode steps of the `tiny` preset with the tables on host vs on device (8 rows,
  interleaved rounds, median step time), the end-to-end cost where the model is small.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ced_jax.config import preset  # noqa: E402
from ced_jax.engram_store import EngramStore, raw_header, table_leaves, table_specs  # noqa: E402


def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ids(cfg, rng, batch: int) -> np.ndarray:
    return np.stack(
        [rng.integers(0, n, (batch, 1, cfg.engram_hash_cols)) for n in cfg.engram_num_embeddings], axis=2
    ).astype(np.int32)


def _time_gather(store, cfg, batches, steps, seed, drop=None) -> dict:
    out = {}
    for batch in batches:
        rng = np.random.default_rng(seed + batch)
        cold, warm = [], []
        for _ in range(steps):
            ids = _ids(cfg, rng, batch)
            if drop is not None:
                drop()
            t = time.perf_counter()
            store.gather(ids)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            store.gather(ids)
            warm.append(time.perf_counter() - t)
        out[str(batch)] = {
            "bytes": batch * store.bytes_per_token,
            "cold_ms_median": round(statistics.median(cold) * 1e3, 3),
            "cold_ms_p90": round(float(np.percentile(cold, 90)) * 1e3, 3),
            "warm_ms_median": round(statistics.median(warm) * 1e3, 3),
        }
    return out


def _open(directory: Path, cfg, madvise: bool) -> EngramStore:
    if madvise:
        return EngramStore.open_raw(directory, cfg)
    specs = table_specs(cfg)  # plain np.memmap: the kernel's default read-ahead around each fault
    return EngramStore(
        cfg,
        [
            tuple(
                np.memmap(directory / f"{leaf}.bin", specs[leaf][1], "r", shape=specs[leaf][0])
                for leaf in pair
            )
            for pair in table_leaves(cfg)
        ],
    )


def real_files(directory: Path, gib: float, batches, steps, madvise: bool) -> dict:
    flash = preset("v41-flash")
    per_row = flash.engram_head_dim + flash.engram_head_dim // 32
    rows = int(gib * (1 << 30) / per_row / len(flash.engram_layer_ids))
    cfg = flash.replace(engram_num_embeddings=(rows,) * len(flash.engram_layer_ids))
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for leaf, (shape, dtype) in table_specs(cfg).items():
        # the raw format by hand (write_raw would need the table in memory first): random bytes
        # (any e4m3 / exponent byte; values do not matter for timing) and the header
        with open(directory / f"{leaf}.bin", "wb") as f:
            piece = 1 << 18
            for begin in range(0, shape[0], piece):
                n = min(piece, shape[0] - begin)
                f.write(rng.integers(0, 256, (n, shape[1]), dtype=np.uint8).tobytes())
        (directory / f"{leaf}.json").write_text(json.dumps(raw_header(cfg, leaf, shape, dtype)))
    written = time.perf_counter() - t
    store = _open(directory, cfg, madvise)
    paths = [directory / f"{leaf}.bin" for leaf in table_specs(cfg)]
    result = _time_gather(store, cfg, batches, steps, 1, drop=lambda: _drop_cache(paths))
    return {
        "rows_per_table": rows,
        "file_bytes": sum(p.stat().st_size for p in paths),
        "write_seconds": round(written, 1),
        "by_batch": result,
    }


def sparse_files(directory: Path, batches, steps, madvise: bool) -> dict:
    cfg = preset("v41-flash")
    for leaf, (shape, dtype) in table_specs(cfg).items():
        header = raw_header(cfg, leaf, shape, dtype)
        with open(directory / f"{leaf}.bin", "wb") as f:
            f.truncate(header["nbytes"])
        (directory / f"{leaf}.json").write_text(json.dumps(header))
    store = _open(directory, cfg, madvise)
    return {
        "apparent_bytes": store.nbytes,
        "by_batch": _time_gather(store, cfg, batches, steps, 2),
    }


def tiny_decode(steps: int, rounds: int = 3) -> dict:
    import jax

    from ced_jax.api import load

    models = {p: load("tiny", engram_placement=p) for p in ("device", "host")}
    sessions = {p: m.new_session(8, 256) for p, m in models.items()}
    tokens = np.full((8, 1), 5, np.int32)
    for s in sessions.values():  # compile + warm
        s.step_and_sample(tokens, 0.0, 0)
        s.step_and_sample(tokens, 0.0, 0)
    times = {p: [] for p in sessions}
    for _ in range(rounds):
        for p, s in sessions.items():
            for _ in range(steps):
                t = time.perf_counter()
                s.step_and_sample(tokens, 0.0, 0)
                times[p].append(time.perf_counter() - t)
    store = models["host"].engram_store
    ids = _ids(models["host"].cfg, np.random.default_rng(0), 8)
    t = time.perf_counter()
    for _ in range(100):
        store.gather(ids)
    gather = (time.perf_counter() - t) / 100
    return {
        "backend": jax.default_backend(),
        "batch": 8,
        "step_ms_median": {p: round(statistics.median(v) * 1e3, 3) for p, v in times.items()},
        "host_gather_ms": round(gather * 1e3, 4),
        "input_bytes_per_step": {
            "host": 8 * store.bytes_per_token,
            "device": 8 * len(store.tables) * store.cfg.engram_hash_cols * 4,  # i32 ids
        },
        "table_bytes": store.nbytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB of real rows on disk (both tables)")
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temporary dir)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-madvise", action="store_true", help="plain np.memmap (kernel read-ahead)")
    ap.add_argument("--tiny", action="store_true", help="also time tiny decode steps, host vs device")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    flash = preset("v41-flash")
    report = {
        "v41_flash": {
            "rows_per_token": len(flash.engram_layer_ids) * flash.engram_hash_cols,
            "bytes_per_row": flash.engram_head_dim + flash.engram_head_dim // 32,
            "bytes_per_token": len(flash.engram_layer_ids)
            * flash.engram_hash_cols
            * (flash.engram_head_dim + flash.engram_head_dim // 32),
            "table_bytes": sum(
                int(np.prod(s)) * np.dtype(d).itemsize for s, d in table_specs(flash).values()
            ),
        }
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        real = Path(tmp) / "real"
        real.mkdir()
        report["madvise_random"] = not args.no_madvise
        report["real"] = real_files(real, args.gib, batches, args.steps, not args.no_madvise)
        for f in real.iterdir():
            f.unlink()
        sparse = Path(tmp) / "sparse"
        sparse.mkdir()
        report["sparse"] = sparse_files(sparse, batches, args.steps, not args.no_madvise)
    if args.tiny:
        report["tiny"] = tiny_decode(args.steps)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
