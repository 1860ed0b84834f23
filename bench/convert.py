"""Benchmark `convert_weights` on a synthetic checkpoint of at least 4 GiB in the released format.

    python bench/convert.py [--work DIR] [--modes compressed,uncompressed] [--record] [--keep]

1. Generates, with `conversion.synthetic` (the `mid` scheme, seed 3000), the `mid` config
   (bench/configs/mid) scaled up to 4.3 GiB: vocabulary 786,432 (embed and head 1.6 GB each, the
   largest tensor groups, as the 1.85 GB embed of the release is one of its large groups) and two
   Engram tables of 3.9 M rows (250 MB each); layers, experts and attention as in `mid`. Six shards
   (embed | layers 0-3 | layers 4-7 | norm + head | one per Engram table) so the generator never
   holds more than one 1.6 GB tensor.
2. Converts it in a child process (`python -m ced_cli.main convert ... --quiet`) once per mode, and
   reports wall time, source GB/s, and the child's peak RSS both as its own VmHWM (printed in the
   converter's summary) and as getrusage(RUSAGE_CHILDREN).ru_maxrss, against the bound of the
   issue: the largest tensor group (output bytes) + 1 GiB.
3. With --record, appends a section to BENCHMARKS.md. Deletes the synthetic files at the end
   (unless --keep). Free disk is checked first: the source plus one output, with margin.

The child process is the measured one, so the generator's memory does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from ced_jax.config import ModelConfig  # noqa: E402
from conversion.mapping import hf_inventory  # noqa: E402
from conversion.synthetic import write_synthetic_checkpoint  # noqa: E402

MID = REPO / "bench" / "configs" / "mid"
SEED = 3000
VOCAB = 786_432
ENGRAM_ROWS = (3_900_007, 3_900_029)
GIB = 1 << 30


def bench_config() -> ModelConfig:
    cfg = ModelConfig.from_pretrained(MID)
    return cfg.replace(vocab_size=VOCAB, engram_num_embeddings=ENGRAM_ROWS, name="mid-4g")


def shard_plan(cfg: ModelConfig) -> list[list[str]]:
    inv = hf_inventory(cfg)
    half = cfg.num_layers // 2
    plan: list[list[str]] = [["embed.weight"], [], [], ["norm.weight", "head.weight"]]
    tables: dict[str, list[str]] = {}
    for name, spec in inv.items():
        if spec.group == "engram_table":
            tables.setdefault(name.rsplit(".", 1)[0], []).append(name)
        elif name.startswith("layers."):
            plan[1 if int(name.split(".")[1]) < half else 2].append(name)
    return plan + list(tables.values())


def write_hf_config(cfg: ModelConfig, path: Path) -> None:
    """mid's config.json with the two scaled keys changed (everything else byte-identical in meaning)."""
    raw = json.loads((MID / "config.json").read_text())
    text = raw.get("text_config", raw)
    text["vocab_size"] = cfg.vocab_size
    text["engram_num_embeddings"] = list(cfg.engram_num_embeddings)
    path.write_text(json.dumps(raw, indent=2) + "\n")
    if ModelConfig.from_pretrained(path.parent) != cfg:  # name is not compared
        raise SystemExit("bench config.json does not round-trip to the bench ModelConfig")


def human(n: float) -> str:
    return f"{n / 1e9:.2f} GB ({n / GIB:.2f} GiB)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ced-convert-bench"))
    ap.add_argument("--modes", default="compressed,uncompressed", help="compressed and/or uncompressed")
    ap.add_argument("--record", action="store_true", help="append the results to BENCHMARKS.md")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and outputs")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"compressed", "uncompressed"}:
        raise SystemExit(f"--modes: unknown {modes}")

    cfg = bench_config()
    inv = hf_inventory(cfg)
    source_bytes = sum(s.nbytes for s in inv.values())
    assert source_bytes >= 4 * GIB, source_bytes
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    need = int(2.4 * source_bytes)  # source + one output (compression saves a little) + margin
    if free < need:
        raise SystemExit(f"{work}: {human(free)} free, need about {human(need)}")
    src, out = work / "hf", work / "out"
    results = []
    try:
        t0 = time.perf_counter()
        if not (src / "model.safetensors.index.json").exists():
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir()
            write_hf_config(cfg, work / "config.json")
            write_synthetic_checkpoint(
                cfg, src, seed=SEED, shard_plan=shard_plan(cfg),
                config_path=work / "config.json",
                tokenizer_files=[MID / "tokenizer.json", MID / "tokenizer_config.json",
                                 MID / "engram_token_map.json"],
            )  # fmt: skip
        gen_s = time.perf_counter() - t0
        files = sorted(p for p in src.iterdir() if p.suffix == ".safetensors")
        print(
            f"source: {len(files)} shards, {len(inv)} tensors, {human(source_bytes)}; "
            f"generated in {gen_s:.0f} s",
            file=sys.stderr,
        )
        for mode in modes:
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "ced_cli.main", "convert", "--hf-dir", str(src), "--out", str(out),
                   "--quiet"] + (["--no-compression"] if mode == "uncompressed" else [])  # fmt: skip
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            t = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                raise SystemExit(f"convert failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
            maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
            if maxrss < before * 1024:
                maxrss = None  # an earlier child was bigger: ru_maxrss cannot tell this one apart
            bound = summary["largest_group_bytes"] + GIB
            row = {
                "mode": mode,
                "wall_s": round(wall, 1),
                "convert_s": summary["seconds"],
                "gb_per_s": round(source_bytes / summary["seconds"] / 1e9, 3),
                "vm_hwm": summary["peak_rss_bytes"],
                "ru_maxrss": maxrss,
                "largest_group": summary["largest_group"],
                "largest_group_bytes": summary["largest_group_bytes"],
                "bound": bound,
                "within_bound": summary["peak_rss_bytes"] < bound,
                "written_bytes": summary["written_bytes"],
                "leaves": summary["leaves"],
                "tensors": summary["tensors"],
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
    print(
        json.dumps({"source_bytes": source_bytes, "generate_s": round(gen_s, 1), "runs": results}, indent=1)
    )
    if args.record:
        record(cfg, source_bytes, len(files), len(inv), gen_s, results)
    return 0 if all(r["within_bound"] for r in results) else 1


def record(cfg: ModelConfig, source_bytes: int, n_files: int, n_tensors: int, gen_s: float, rows) -> None:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        "",
        f"## convert_weights: streaming conversion ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `python bench/convert.py --record` (synthetic `{cfg.name}`: bench/configs/mid with "
        f"vocabulary {cfg.vocab_size:,} and Engram tables of {cfg.engram_num_embeddings[0]:,} rows; "
        f"{n_files} shards, {n_tensors:,} tensors, {human(source_bytes)}; generated in {gen_s:.0f} s). "
        f"Machine: {os.cpu_count()} vCPU, {mem / GIB:.0f} GiB RAM, no accelerator ({platform.machine()}, "
        "shared with other jobs, so times are indicative). The converter runs in a child process; peak RSS "
        "is its VmHWM (ru_maxrss agrees where shown). Bound: largest tensor group (output bytes) + 1 GiB.",
        "",
        "| mode | convert s | source GB/s | peak RSS (VmHWM) | ru_maxrss | largest group | bound | within "
        "| written |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        maxrss = "-" if r["ru_maxrss"] is None else f"{r['ru_maxrss'] / GIB:.2f} GiB"
        lines.append(
            f"| {r['mode']} | {r['convert_s']:.1f} | {r['gb_per_s']:.3f} | {r['vm_hwm'] / GIB:.2f} GiB "
            f"| {maxrss} "
            f"| {r['largest_group']} {r['largest_group_bytes'] / GIB:.2f} GiB | {r['bound'] / GIB:.2f} GiB "
            f"| {'yes' if r['within_bound'] else 'NO'} | {r['written_bytes'] / GIB:.2f} GiB |"
        )
    path = REPO / "BENCHMARKS.md"
    if not path.exists():
        path.write_text("# Benchmarks\n\nEach section: the command, the machine, the numbers. Append only.\n")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
