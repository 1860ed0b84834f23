"""Start-up with a cold and a warm persistent compilation cache, side by side in one run.

    python bench/cold_start.py [MODEL] [--runs 2] [serve flags after --]

For each run: a fresh cache directory, then `ced-jax serve MODEL` twice on it (cold, then warm), each
timed from the process start to the "ced-jax serving" line and split as the server reports it (model
load; warm-up: executables compiled, loaded from the cache, the rest tracing and running); then the
same for `ced-jax generate MODEL` (wall time to exit). Prints one JSON object with every run and the
median warm / cold ratios. Both commands run as real subprocesses with `--compilation-cache-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STARTED = re.compile(
    r"started in ([\d.]+) s: load ([\d.]+) s, warm-up ([\d.]+) s \((\d+) program calls: (\d+) executables "
    r"compiled in ([\d.]+) s, (\d+) loaded from the compilation cache in ([\d.]+) s"
)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(model: str, cache: Path, flags: list[str], log: Path) -> dict:
    cmd = [
        sys.executable, "-m", "ced_cli.main", "serve", model, *flags, "--port", str(_free_port()),
        "--metrics-port", "-1", "--http-port", "-1", "--compilation-cache-dir", str(cache),
    ]  # fmt: skip
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        while "ced-jax serving" not in log.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited {proc.returncode}:\n{log.read_text()}")
            time.sleep(0.05)
        serving = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    m = STARTED.search(log.read_text())
    if m is None:
        raise RuntimeError(f"no start-up line in:\n{log.read_text()}")
    load, warm = float(m.group(2)), float(m.group(3))
    return {
        "to_serving_s": round(serving, 2),
        "process_start_s": round(serving - load - warm, 2),  # interpreter, imports, port binding
        "load_s": load,
        "warmup_s": warm,
        "program_calls": int(m.group(4)),
        "compiled": int(m.group(5)),
        "compile_s": float(m.group(6)),
        "from_cache": int(m.group(7)),
        "cache_load_s": float(m.group(8)),
        "warmup_other_s": round(warm - float(m.group(6)) - float(m.group(8)), 2),
    }


def generate_once(model: str, cache: Path) -> dict:
    cmd = [
        sys.executable, "-m", "ced_cli.main", "generate", model, "--prompt", "hello world", "--max-tokens",
        "16", "--json", "--compilation-cache-dir", str(cache),
    ]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(run.stderr)
    return {"wall_s": round(time.perf_counter() - start, 2), "token_ids": json.loads(run.stdout)["token_ids"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="tiny")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("serve_flags", nargs="*", help="flags for serve (after --)")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            cache, log = Path(tmp) / "serve-xla", Path(tmp) / "serve.log"
            serve = [serve_once(args.model, cache, args.serve_flags, log) for _ in range(2)]
            gen_cache = Path(tmp) / "generate-xla"
            gen = [generate_once(args.model, gen_cache) for _ in range(2)]
            assert gen[0]["token_ids"] == gen[1]["token_ids"], "warm generate gave other tokens"
            runs.append(
                {"serve": {"cold": serve[0], "warm": serve[1]}, "generate": {"cold": gen[0], "warm": gen[1]}}
            )
    ratio = lambda kind, key: statistics.median(r[kind]["warm"][key] / r[kind]["cold"][key] for r in runs)
    print(
        json.dumps(
            {
                "model": args.model,
                "serve_flags": args.serve_flags,
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "runs": runs,
                "median_warm_over_cold": {
                    "serve_to_serving": round(ratio("serve", "to_serving_s"), 3),
                    "generate_wall": round(ratio("generate", "wall_s"), 3),
                },
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
