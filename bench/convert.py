"""Benchmark `convert_weights` on a synthetic checkpoint of at least 4 GiB in the released format.

    python bench/convert.py [--work DIR] [--modes compressed,uncompressed] [--keep]

1. Generates, with `conversion.synthetic` (the `mid` scheme, seed 3000), the `mid` config
   (bench/configs/mid) scaled up to 4.3 GiB: vocabulary 786,432 (embed and head 1.6 GB each, the
   largest tensor groups, as the 1.85 GB embed of the release is one of its large groups) and two
   Engram tables of 3.9 M rows (250 MB each); layers, experts and attention as in `mid`. Six shards
   (embed | layers 0-3 | layers 4-7 | norm + head | one per Engram table) so the generator never
   holds more than one 1.6 GB tensor. The generator runs in a child process of its own.
2. Converts it in a child process (`python -m ced_cli.main convert ... --quiet`) once per mode and
   measures that process's peak RSS three ways: its own VmHWM (printed in the converter's
   summary), VmHWM sampled from /proc/PID/status every 50 ms, and ru_maxrss from wait4() on that
   pid. The bound of the issue is the largest tensor group (output bytes) + 1 GiB. Throughput is
   source bytes / the converter's own time (validation pass included) and / wall time (interpreter
   start and imports included).
3. Prints one JSON line per run, then a markdown table (the BENCHMARKS.md "Conversion" rows).
   Deletes the synthetic files at the end (unless --keep; a kept source is reused). Free disk is
   checked first: the source plus one output, with margin. Exit status 1 if a run broke the bound.

Measuring a child keeps the generator's memory out of the numbers; the generator is a separate
child too, because ru_maxrss of a child starts from its parent's resident set at fork time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from ced_jax.checkpoint.mapping import hf_inventory  # noqa: E402
from ced_jax.config import ModelConfig  # noqa: E402
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


def generate(work: Path) -> None:
    cfg = bench_config()
    src = work / "hf"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    write_hf_config(cfg, work / "config.json")
    write_synthetic_checkpoint(
        cfg, src, seed=SEED, shard_plan=shard_plan(cfg),
        config_path=work / "config.json",
        tokenizer_files=[MID / "tokenizer.json", MID / "tokenizer_config.json",
                         MID / "engram_token_map.json"],
    )  # fmt: skip


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_measured(cmd: list[str], log: Path) -> tuple[int, float, int, int, str]:
    """Run `cmd`; (exit code, wall s, sampled VmHWM bytes, wait4 ru_maxrss bytes, stdout)."""
    with open(log, "w") as err, open(log.with_suffix(".out"), "w") as out:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err)
        sampled = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            sampled = max(sampled, _vm_hwm(proc.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait again
    return proc.returncode, wall, sampled, usage.ru_maxrss * 1024, log.with_suffix(".out").read_text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ced-convert-bench"))
    ap.add_argument("--modes", default="compressed,uncompressed", help="compressed and/or uncompressed")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and outputs")
    ap.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args(argv)
    work = args.work.resolve()
    if args.generate_only:
        generate(work)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"compressed", "uncompressed"}:
        raise SystemExit(f"--modes: unknown {modes}")

    cfg = bench_config()
    inv = hf_inventory(cfg)
    source_bytes = sum(s.nbytes for s in inv.values())
    assert source_bytes >= 4 * GIB, source_bytes
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "hf", work / "out"
    free = shutil.disk_usage(work).free + sum(f.stat().st_size for f in work.rglob("*") if f.is_file())
    need = int(2.4 * source_bytes)  # source + one output (compression saves a little) + margin
    if free < need:
        raise SystemExit(f"{work}: {human(free)} free, need about {human(need)}")
    results = []
    gen_s = 0.0
    try:
        if not (src / "model.safetensors.index.json").exists():
            t0 = time.perf_counter()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--work", str(work), "--generate-only"]
            subprocess.run(cmd, cwd=REPO, check=True)
            gen_s = time.perf_counter() - t0
        files = sorted(p for p in src.iterdir() if p.suffix == ".safetensors")
        on_disk = sum(p.stat().st_size for p in files)
        print(
            f"source: {len(files)} shards, {len(inv)} tensors, {human(on_disk)} on disk; "
            f"generated in {gen_s:.0f} s (0: reused)",
            file=sys.stderr,
        )
        for mode in modes:
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "ced_cli.main", "convert", "--hf-dir", str(src), "--out", str(out),
                   "--quiet"] + (["--no-compression"] if mode == "uncompressed" else [])  # fmt: skip
            rc, wall, sampled, maxrss, stdout = run_measured(cmd, work / f"convert-{mode}.log")
            if rc != 0:
                tail = (work / f"convert-{mode}.log").read_text()[-3000:]
                raise SystemExit(f"convert failed ({rc}):\n{tail}")
            summary = json.loads(stdout.strip().splitlines()[-1])
            bound = summary["largest_group_bytes"] + GIB
            peak = max(summary["peak_rss_bytes"], sampled, maxrss)
            files_out = sum(1 for f in out.rglob("*") if f.is_file())
            row = {
                "mode": mode,
                "wall_s": round(wall, 1),
                "convert_s": summary["seconds"],
                "gb_per_s": round(summary["source_bytes"] / summary["seconds"] / 1e9, 4),
                "gb_per_s_wall": round(summary["source_bytes"] / wall / 1e9, 4),
                "vm_hwm_self": summary["peak_rss_bytes"],
                "vm_hwm_sampled": sampled,
                "ru_maxrss": maxrss,
                "peak": peak,
                "largest_group": summary["largest_group"],
                "largest_group_bytes": summary["largest_group_bytes"],
                "bound": bound,
                "within_bound": peak < bound,
                "source_bytes": summary["source_bytes"],
                "written_bytes": summary["written_bytes"],
                "files_written": files_out,
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
    print(markdown(results))
    return 0 if all(r["within_bound"] for r in results) else 1


def markdown(rows: list[dict]) -> str:
    lines = [
        "| mode | convert s (wall) | source GB/s (wall) | peak RSS: self VmHWM / sampled / ru_maxrss "
        "| largest group | bound | held | written (files) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['convert_s']:.1f} ({r['wall_s']:.1f}) | {r['gb_per_s']:.3f} "
            f"({r['gb_per_s_wall']:.3f}) | {r['vm_hwm_self'] / GIB:.2f} / {r['vm_hwm_sampled'] / GIB:.2f} / "
            f"{r['ru_maxrss'] / GIB:.2f} GiB "
            f"| `{r['largest_group']}` {r['largest_group_bytes'] / GIB:.2f} GiB "
            f"| {r['bound'] / GIB:.2f} GiB | {'yes' if r['within_bound'] else 'NO'} "
            f"| {r['written_bytes'] / GIB:.2f} GiB ({r['files_written']}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
