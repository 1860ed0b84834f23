"""Benchmark loading onto a mesh (issue 12.2): host peak RSS of `ced_jax.load(path, mesh=...)` on 8
fake CPU devices, for a synthetic released-format checkpoint of at least 4 GB and its Orbax conversion.

    python bench/load_mesh.py [--work DIR] [--experts 640] [--mesh expert=4,tensor=2] [--keep]
    python bench/load_mesh.py child --model DIR --mesh expert=4,tensor=2 [--via-host]   # one measurement

1. Writes a checkpoint in the released layout (`write_random_checkpoint`: the names, stored dtypes,
   shapes, shard files, index and config.json of the release, for `bench/configs/mid` with
   `--experts` routed experts per layer: 640 gives 4.37 GB in 3 shards, the largest tensor group a
   stacked expert weight of 168 MB). The values are random bytes, not the `mid` draws (which take
   minutes to generate for 4 GB): FP8 bytes avoid the two NaN codes, E8M0 scales lie in 2^-9..2^3,
   bf16 / f32 are normal draws. Loading moves bytes, it does not look at them.
2. Converts it with `conversion.convert` (uncompressed, Engram as a separate item + raw tables).
3. For each of the two, a fresh child process (`child`, with
   XLA_FLAGS=--xla_force_host_platform_device_count=8) imports JAX, builds the mesh, touches every
   device, records its resident set (VmRSS, the baseline), resets its peak (`/proc/self/clear_refs`
   5: VmHWM := VmRSS), runs `ced_jax.load(path, mesh=mesh)` and reads VmHWM.

What is measured and why: on fake CPU devices every device buffer is this process's memory, so the
placed parameters themselves are in the resident set (and must be). The host transient is
    peak - baseline - placed bytes - host-resident Engram bytes,
where placed bytes = the bytes of the distinct device buffers of every parameter (a replicated
parameter holds one per device; XLA:CPU may alias a host numpy buffer instead of copying it, so
buffers are counted by address, once each) and the Engram bytes are the host tables a `Model` keeps
by design (numpy tables of the HF path; the converted path memory-maps its raw files, counted as
their resident pages only, i.e. not at all here). The issue's bound is: transient <= the largest
tensor group (the largest parameter as placed: bf16 widened to f32 on CPU) + 1 GiB, and never the
whole model. `--via-host` measures the path `load` took before (the whole checkpoint read into host
numpy, then placed) for contrast; the test (tests/ced_jax/checkpoint/test_load_mesh.py) uses it to
show that the measurement fails such a load.

Prints one JSON line per run, then the BENCHMARKS.md table. Deletes the files unless --keep.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

GIB = 1 << 30
MID = REPO / "bench" / "configs" / "mid"


# ---------------------------------------------------------------------- the synthetic checkpoint
def bench_config(experts: int):
    from ced_jax.config import ModelConfig

    cfg = ModelConfig.from_pretrained(MID)
    return cfg.replace(n_routed_experts=experts, name=f"mid-e{experts}")


def write_config(cfg, path: Path) -> None:
    """mid's config.json with n_routed_experts changed; checked to read back as `cfg`."""
    from ced_jax.config import ModelConfig

    raw = json.loads((MID / "config.json").read_text())
    raw.get("text_config", raw)["n_routed_experts"] = cfg.n_routed_experts
    path.write_text(json.dumps(raw, indent=2) + "\n")
    if ModelConfig.from_pretrained(path.parent) != cfg:
        raise SystemExit("bench config.json does not round-trip to the bench ModelConfig")


def _random_tensor(rng, dtype: str, shape: tuple[int, ...]):
    import ml_dtypes
    import numpy as np

    n = int(np.prod(shape))
    if dtype == "BF16":
        return rng.standard_normal(n, dtype=np.float32).astype(ml_dtypes.bfloat16)
    if dtype == "F32":
        return rng.standard_normal(n, dtype=np.float32)
    if dtype == "F8_E8M0":
        return rng.integers(118, 131, n, dtype=np.uint8)  # 2^-9 .. 2^3
    b = rng.integers(0, 256, n, dtype=np.uint8)
    if dtype == "F8_E4M3":
        b[(b & 0x7F) == 0x7F] = 0  # no NaN codes
    return b  # I8: packed FP4 pairs, any byte


def write_random_checkpoint(cfg, out: Path, *, seed: int = 0) -> dict:
    """Released layout for `cfg` (shards as `conversion.synthetic.default_shard_plan`, index,
    config.json), random values (module docstring), written tensor by tensor."""
    import numpy as np

    from ced_jax.checkpoint.hf_loader import INDEX_NAME
    from ced_jax.checkpoint.mapping import hf_inventory
    from conversion.synthetic import default_shard_plan, shard_file_names

    out.mkdir(parents=True, exist_ok=True)
    inv = hf_inventory(cfg)
    plan = default_shard_plan(cfg)
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for file, names in zip(shard_file_names(len(plan)), plan, strict=True):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            s = inv[name]
            header[name] = {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
            weight_map[name] = file
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name in names:
                arr = _random_tensor(rng, inv[name].dtype, inv[name].shape)
                assert arr.nbytes == inv[name].nbytes, name
                f.write(arr.tobytes())
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    write_config(cfg, out / "config.json")
    shutil.copyfile(MID / "tokenizer.json", out / "tokenizer.json")
    return {"total_size": total, "tensors": len(weight_map), "files": len(plan)}


# ---------------------------------------------------------------------- one measurement (child)
def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def child(model: str, mesh_text: str, via_host: bool) -> dict:
    import jax
    import ml_dtypes
    import numpy as np

    # Imported up front: Orbax and TensorStore are libraries (~70 MB resident once imported), not
    # loading buffers, and the converted path would otherwise import them inside the measurement.
    import orbax.checkpoint  # noqa: F401

    import ced_jax
    from ced_jax import sharding
    from ced_jax.api import Model
    from ced_jax.checkpoint.place import mesh_targets

    mesh = sharding.make_mesh(sharding.parse_mesh(mesh_text))
    n_dev = len(jax.devices())
    jax.block_until_ready(jax.device_put(np.zeros(8 * n_dev, np.float32), sharding.replicated(mesh)))
    import gc

    gc.collect()
    baseline = _status("VmRSS")
    reset = _reset_peak()
    start_peak = _status("VmHWM")
    t0 = time.perf_counter()
    if via_host:  # the previous path: every parameter in host numpy first, then placed
        from ced_jax.checkpoint.hf_loader import load_hf_checkpoint
        from ced_jax.config import ModelConfig

        cfg = ModelConfig.from_pretrained(model)
        flat, _ = load_hf_checkpoint(model, cfg)
        m = Model(cfg, flat, hasher=None, tokenizer_path=None, mesh=mesh)
        del flat
    else:
        m = ced_jax.load(model, mesh=mesh)
    jax.block_until_ready(m.params)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    after = _status("VmRSS")
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after_trim = _status("VmRSS")
    buffers: dict[int, int] = {}  # device buffer address -> bytes (aliased host buffers count once)
    wrong = []
    targets = mesh_targets(m.cfg, mesh, m.rules)
    for path, leaf in jax.tree_util.tree_leaves_with_path(m.params):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        for s in leaf.addressable_shards:
            buffers[s.data.unsafe_buffer_pointer()] = s.data.nbytes
        if name in targets and not leaf.sharding.is_equivalent_to(targets[name], leaf.ndim):
            wrong.append(name)
    placed = sum(buffers.values())
    engram_host = 0
    store = getattr(m, "engram_store", None)
    if store is not None:
        for pair in store.tables:
            for t in pair:
                if isinstance(t, np.ndarray) and not isinstance(t, np.memmap) and t.base is None:
                    engram_host += t.nbytes
    largest = 0
    for name in targets:
        leaf = m.params
        for part in name.split("."):
            leaf = leaf[part]
        largest = max(largest, int(np.prod(leaf.shape)) * leaf.dtype.itemsize)
    model_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(m.params))
    digests = {}  # of each parameter's bytes, as the host sees them (after the measurement)
    for name, leaf in _flat(m.params).items():
        digests[name] = hashlib.sha256(np.ascontiguousarray(np.asarray(leaf)).tobytes()).hexdigest()
    del ml_dtypes
    return {
        "model": model,
        "mesh": mesh_text,
        "via_host": via_host,
        "devices": n_dev,
        "seconds": round(seconds, 2),
        "peak_reset": reset,
        "baseline": baseline,
        "start_peak": start_peak,
        "peak": peak,
        "after": after,
        "after_trim": after_trim,
        "placed": placed,
        "engram_host": engram_host,
        "model_bytes": model_bytes,
        "largest_group": largest,
        "transient": peak - baseline - placed - engram_host,
        "wrong_shardings": wrong,
        "digests": digests,
    }


def _flat(params) -> dict:
    import jax

    return {
        ".".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


def run_child(model: Path, mesh: str, *, via_host: bool = False, timeout: float = 3600) -> dict:
    """One measurement in a fresh process with 8 fake CPU devices; its JSON result."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(Path(__file__).resolve()), "child", "--model", str(model), "--mesh", mesh]
    if via_host:
        cmd.append("--via-host")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- main
def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--model", required=True)
    c.add_argument("--mesh", required=True)
    c.add_argument("--via-host", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/load_mesh_bench"))
    ap.add_argument("--experts", type=int, default=640)
    ap.add_argument("--mesh", default="expert=4,tensor=2")
    ap.add_argument("--via-host", action="store_true", help="also measure the host-first path (HF)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "child":
        print(json.dumps(child(args.model, args.mesh, args.via_host)), flush=True)
        return 0

    cfg = bench_config(args.experts)
    hf, conv = args.work / "hf", args.work / "converted"
    if not (hf / "config.json").is_file():
        t0 = time.perf_counter()
        info = write_random_checkpoint(cfg, hf)
        print(json.dumps({"generated": info, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    if not (conv / "ced_manifest.json").is_file():
        from conversion.convert import ConvertOptions, convert

        t0 = time.perf_counter()
        convert(hf, conv, ConvertOptions(progress=False, compression=False))
        print(json.dumps({"converted_seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    runs = [("HF directory", hf, False), ("Orbax conversion", conv, False)]
    if args.via_host:
        runs.append(("HF, host-first (previous path)", hf, True))
    rows = []
    ok = True
    for label, path, via_host in runs:
        r = run_child(path, args.mesh, via_host=via_host)
        print(json.dumps({k: v for k, v in r.items() if k != "digests"}), flush=True)
        bound = r["largest_group"] + GIB
        held = r["transient"] <= bound and not r["wrong_shardings"]
        ok &= held or via_host
        rows.append(
            f"| {label} | {r['seconds']} | {_gib(r['baseline'])} | {_gib(r['peak'])} | {_gib(r['placed'])} "
            f"| {_gib(r['engram_host'])} | {_gib(r['transient'])} | {_gib(r['largest_group'])} | "
            f"{_gib(bound)} | {'yes' if held else 'no'} |"
        )
    print(
        "| source | load s | baseline RSS | peak RSS | placed on devices | Engram on host | transient "
        "| largest group | bound | held |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
