"""Compiled proof of a memory plan: lower and compile the serving programs from abstract inputs.

`ced-jax plan ... --compile` asks XLA what the planner's ledgers estimate. The real prefill and
decode programs of the engine (`ced_jax.engine.programs.Programs.prefill_batch` and `.decode`, as a server
compiles them: `--max-seqs` decode rows, `prefill_rows` x `--prefill-bucket` prefill rows, the
server's page size and max_logprobs) are lowered with `jax.ShapeDtypeStruct` arguments that carry
their `NamedSharding`s, the parameters in their storage dtypes (FP4 experts packed, FP8 + ue8m0, BF16
/ F32 as released: an accelerator's layout, not the f32 widening `ced_jax.load` does on CPU), the
engine state at the serving shapes (`ced_jax.engine.new_state` under `jax.eval_shape`) and the
replicated step inputs, on a mesh of fake CPU devices; then compiled. Nothing is allocated: no
weights are read and no buffer is made. `compiled.memory_analysis()` gives XLA's per-device
argument, output, aliased and temporary bytes of each program.

Per device, the total is arguments + outputs - aliased + temporaries: the state is donated
(`donate_argnames=("state",)`), so XLA writes the new state into the old one's buffers and those
bytes appear both as argument and as output but are held once (`alias_size_in_bytes`).

The comparison with the planner's ledgers (`compare`), per program and per device: the arguments
are the parameters (weights ledger), the state (KV ledger) and the step's inputs (not a ledger;
the gathered Engram rows of the step when the tables are on the host), less what jit drops as
unused (the text decode program never reads `gate.bias_vl`: 4 x experts bytes per layer; the
prefill keeps every parameter, passed through its page loop's barrier); the temporaries
are XLA's buffer assignment for everything live inside the program, which the activations ledger
estimates; outputs beside the donated state are the sampler's results. The temporaries are
XLA:CPU's, with its memory-minimising scheduler by default (`SCHEDULERS`): what the program needs
when scheduled for memory, as an accelerator backend schedules under its memory limit; an
accelerator's fusion decisions differ, so its temporaries are not the same number. What the
reference path holds, measured here on v41-flash: both programs one sublayer's f32 weight copy at a
time (the largest is the head's) beside a small step;
the prefill kept an f32 copy of every dense FP8 / BF16 weight until its page loop tied the
parameters to the loop counter (XLA had hoisted the dequantisation out of the loop:
`ced_jax.engine.programs._loop_params`); BENCHMARKS.md has the numbers.

Fake devices: `--xla_force_host_platform_device_count` (here `jax_num_cpu_devices`) must be set
before JAX initialises its backends, so `run_compile` runs this module in fresh processes
(`python -m serving.planning.compile_proof ...`), one per process of the mesh (several: jax.distributed on
localhost, every process compiling the same SPMD program); `compile_in_process` is for a process
that already has enough devices (it refuses a mesh its devices cannot hold).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ced_jax import sharding
from ced_jax.checkpoint.mapping import TEXT_GROUPS, is_engram_table, our_param_specs
from ced_jax.config import PRESETS, ModelConfig, preset
from ced_jax.model import flatten_specs, param_specs
from ced_jax.trees import nest
from serving.config import LONG_PREFILL_CHUNK, ServeConfig, default_long_prefill_chunk

SERVE = ServeConfig()
REPO = Path(__file__).resolve().parents[2]
PROGRAMS = ("prefill", "decode", "long_prefill")


def server_programs(context: int) -> tuple[str, ...]:
    """The programs a server compiles at this context with its defaults: the long-prompt prefill
    (`ServeConfig.long_prefill_chunk`) only from 4x LONG_PREFILL_CHUNK on."""
    return ("prefill", "decode") + (("long_prefill",) if default_long_prefill_chunk(context) else ())


# XLA:CPU's instruction schedulers (`xla_cpu_scheduler_type`). Its default schedules for concurrency on
# the host's threads and computes every layer's weight dequantisation ahead of the layers (all of them
# live at once); "memory" is its memory-minimising scheduler, the one that shows what a program needs.
SCHEDULERS = {
    "memory": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    "default": None,
}


class CompileProofError(ValueError):
    """A compiled proof that cannot run as asked (a mesh the devices cannot hold, a failed process)."""


# ---------------------------------------------------------------------- abstract inputs
def abstract_params(cfg: ModelConfig, mesh, rules, *, engram_on_host: bool) -> dict:
    """The parameter tree as ShapeDtypeStructs in the checkpoint's storage dtypes (`our_param_specs`,
    what `ced_jax.load` holds on an accelerator) with the shardings the runtime places them with
    (`sharding.param_shardings` over the parameters' logical axes). engram_on_host: without the
    Engram tables (`layers.{i}.engram.embed`), which stay in host memory."""
    specs = flatten_specs(param_specs(cfg))
    stored = our_param_specs(cfg, TEXT_GROUPS)
    if set(specs) != set(stored):
        raise AssertionError(f"parameter trees disagree: {sorted(set(specs) ^ set(stored))[:5]}")

    def abstract(path: str, spec):
        shape, dtype = stored[path]
        pspec = sharding.logical_to_spec(spec.axes, rules, shape, mesh, name=f"parameter {path}")
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, pspec))

    kept = {path: spec for path, spec in specs.items() if not (engram_on_host and is_engram_table(path))}
    return nest(kept, abstract)


def abstract_state(cfg: ModelConfig, shapes, mesh, rules):
    """The engine's state at `shapes` (`ced_jax.engine.StateShapes`) as ShapeDtypeStructs laid out as
    `new_state` lays it out on `mesh`."""
    from ced_jax import cache as cache_lib
    from ced_jax.engine import state_shardings

    state = jax.eval_shape(
        lambda: cache_lib.init_paged_cache(
            cfg, max_slots=shapes.max_slots, page_size=shapes.page_size, num_pages=shapes.num_pages
        )
    )
    shards = state_shardings(state, mesh, rules)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shards)


def _engram_inputs(cfg: ModelConfig, rows: int, tokens: int, engram_on_host: bool, whole):
    """The Engram part of a step's inputs: the hash row ids i32 [R, T, n_layers, C] (tables on
    device), or the gathered rows (tables on the host: FP8 [R, T, n_layers, C, ehd] + ue8m0 scales)."""
    if not cfg.engram_layer_ids:
        return None
    ids = (rows, tokens, len(cfg.engram_layer_ids), cfg.engram_hash_cols)
    if not engram_on_host:
        return jax.ShapeDtypeStruct(ids, np.int32, sharding=whole)
    from ced_jax.model import E8M0, FP8

    ehd = cfg.engram_head_dim
    return {
        "weight": jax.ShapeDtypeStruct((*ids, ehd), FP8, sharding=whole),
        "scale": jax.ShapeDtypeStruct((*ids, ehd // 32), E8M0, sharding=whole),
    }


def _sampling_inputs(cfg: ModelConfig, rows: int, whole):
    from ced_jax.inputs import SamplingBatch
    from ced_jax.sampling import mask_words

    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)
    return SamplingBatch(
        temperature=s((rows,), np.float32),
        top_p=s((rows,), np.float32),
        top_k=s((rows,), np.int32),
        seed=s((rows,), np.uint32),
        token_bitmask=s((rows, mask_words(cfg.vocab_size)), np.int32),
    )


# ---------------------------------------------------------------------- compile
def _analysis(compiled, seconds: float) -> dict:
    m = compiled.memory_analysis()
    args, outs, alias, temps = (
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
    )
    return {
        "arguments_bytes": args,
        "outputs_bytes": outs,
        "aliased_bytes": alias,
        "temporaries_bytes": temps,
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
        "total_bytes": args + outs - alias + temps,
        "compile_seconds": round(seconds, 2),
    }


def _tree_bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for a in jax.tree.leaves(tree):
        shard = a.sharding.shard_shape(a.shape)
        total += math.prod(shard) * np.dtype(a.dtype).itemsize
    return total


def compile_in_process(
    cfg: ModelConfig,
    mesh_sizes: dict[str, int],
    *,
    rules: str = sharding.DEFAULT_RULES,
    engram_on_host: bool,
    max_seqs: int,
    context: int,
    prefill_bucket: int,
    page_size: int,
    prefill_rows: int | None = None,
    programs: tuple[str, ...] | None = None,
    impl: str = "reference",
    scheduler: str = "memory",
    on_compiled: Callable[[str, Any], None] | None = None,
) -> dict:
    """Lower and compile `programs` in this process on a mesh of `mesh_sizes` over all its (global)
    devices; XLA's per-device memory analysis of each, and the per-device bytes of the abstract
    arguments by kind (parameters, state, step inputs). programs: None = `server_programs(context)`.
    on_compiled(name, compiled) sees each compiled program (bench/launches.py reads its HLO)."""
    from ced_jax.cache import StepMetadata
    from ced_jax.engine import Programs, StateShapes
    from ced_jax.engine.batch import StepBatch
    from ced_jax.options import RunOptions

    need = math.prod(mesh_sizes.values())
    have = jax.device_count()
    if need != have:
        raise CompileProofError(
            f"mesh {_mesh_text(mesh_sizes)} needs {need} devices; this JAX runtime has {have} "
            f"({jax.default_backend()}), initialised before the compile was asked for: run the compile "
            f"in a fresh process (`ced-jax plan --compile` does) or with jax_num_cpu_devices={need}"
        )
    programs = server_programs(context) if programs is None else tuple(programs)
    if "long_prefill" in programs and "long_prefill" not in server_programs(context):
        raise ValueError(
            f"programs: a server at context {context} has no long-prompt prefill (see "
            "serving.config.default_long_prefill_chunk)"
        )
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"programs: unknown {unknown}; known: {list(PROGRAMS)}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler: expected one of {sorted(SCHEDULERS)}, got {scheduler!r}")
    xla_options = SCHEDULERS[scheduler] if jax.default_backend() == "cpu" else None
    table = sharding.get_rules(rules)
    mesh = sharding.make_mesh(mesh_sizes)
    whole = sharding.replicated(mesh)
    max_context = -(-context // page_size) * page_size
    shapes = StateShapes(
        max_slots=max_seqs,
        page_size=page_size,
        num_pages=max_seqs * (max_context // page_size),
        max_context=max_context,
    )
    rows = min(4, max_seqs) if prefill_rows is None else prefill_rows
    layout = sharding.make_layout(mesh, table)
    if prefill_rows is None and layout is not None:  # dp_ep: a block of rows per device, as the planner
        rows = -(-rows // layout.attention_shards) * layout.attention_shards
    if prefill_bucket % page_size:
        raise ValueError(f"--prefill-bucket {prefill_bucket} is not a multiple of --page-size {page_size}")
    long_rows = 1 if layout is None else layout.attention_shards  # a busy row, idle ones in other blocks
    params = abstract_params(cfg, mesh, table, engram_on_host=engram_on_host)
    state = abstract_state(cfg, shapes, mesh, table)
    progs = Programs(cfg, mesh=mesh, rules=table)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=whole)
    out: dict = {
        "mesh": dict(mesh_sizes),
        "devices": have,
        "processes": jax.process_count(),
        "backend": jax.default_backend(),
        "impl": impl,
        "scheduler": scheduler,
        "engram_tables": "host" if engram_on_host else "device",
        "shapes": {
            "max_slots": max_seqs,
            "page_size": page_size,
            "num_pages": shapes.num_pages,
            "max_context": max_context,
            "prefill_rows": rows,
            "prefill_chunk": prefill_bucket,
            "long_prefill_rows": long_rows,
            "long_prefill_chunk": LONG_PREFILL_CHUNK,
            "long_prefill_step": SERVE.long_prefill_step,
            "max_logprobs": SERVE.max_logprobs,
        },
        "abstract_per_device": {
            "params_bytes": _tree_bytes_per_device(params),
            "state_bytes": _tree_bytes_per_device(state),
        },
        "programs": {},
    }
    with jax.set_mesh(mesh):
        for name in programs:
            if name == "decode":
                b = max_seqs
                batch = StepBatch(
                    tokens=i32(b),
                    meta=StepMetadata(i32(b), i32(b), i32(b), i32(b, shapes.pages_per_slot)),
                    engram=_engram_inputs(cfg, b, 1, engram_on_host, whole),
                    sampling=_sampling_inputs(cfg, b, whole),
                )
                fn = progs.decode
            else:
                r, c = (rows, prefill_bucket) if name == "prefill" else (long_rows, LONG_PREFILL_CHUNK)
                meta = StepMetadata(
                    start=i32(r),
                    lens=i32(r),
                    slots=i32(r),
                    page_tables=i32(r, shapes.pages_per_slot),
                    window_floor=i32(r, cfg.num_layers),
                    write_from=i32(r),
                    decoder_from=i32(r),
                )
                batch = StepBatch(
                    tokens=i32(r, c),
                    meta=meta,
                    engram=_engram_inputs(cfg, r, c, engram_on_host, whole),
                    sampling=_sampling_inputs(cfg, r, whole),
                )
                fn = progs.prefill_batch
            options = RunOptions(
                impl=impl,
                max_logprobs=SERVE.max_logprobs,
                step_tokens=SERVE.long_prefill_step if name == "long_prefill" else None,
            )
            t0 = time.perf_counter()
            compiled = fn.lower(params, state, batch, options=options).compile(xla_options)
            result = _analysis(compiled, time.perf_counter() - t0)
            if on_compiled is not None:
                on_compiled(name, compiled)
            result["inputs_bytes"] = _tree_bytes_per_device(batch)
            out["programs"][name] = result
    return out


# ---------------------------------------------------------------------- ledgers vs compiled
GIB = 1024**3
TOLERANCE = 0.10  # the ledgers and XLA agree within this share, or the line says why not


def _sampler_bytes(rows: int) -> int:
    """Bytes of `ced_jax.sampling.sample`'s results for `rows` rows: token i32, logprob f32 and the
    max_logprobs top ids i32 and log-probabilities f32 of each row."""
    return rows * (4 + 4 + 2 * 4 * SERVE.max_logprobs)


def compare(candidate: dict, compiled: dict, device_bytes: int) -> dict:
    """The planner's ledgers for `candidate` (a plan's recommended / closest entry) beside XLA's
    memory analysis of the same mesh and placement, line by line per program and per device.

    Arguments are the parameters (weights ledger), the donated state (KV ledger) and the step's
    inputs (counted from the abstract inputs: the ledgers leave them out); temporaries are the
    activations ledger of that program; outputs beside the aliased state are the sampler's results
    (not in the ledgers: a few KiB). Total = arguments + outputs - aliased +
    temporaries. Every line carries the relative difference (compiled / ledger - 1), whether it is
    within TOLERANCE, and what the two numbers hold; a line beyond TOLERANCE says why."""
    led = candidate["ledgers"]
    weights, kv = led["weights"]["per_device"], led["kv"]["per_device"]
    overhead = led["overhead"]["per_device"]
    acts = led["activations"]
    rows = []

    def line(program, name, ledger, got, holds, beyond=""):
        diff = None if ledger == 0 else got / ledger - 1
        ok = got == 0 if ledger == 0 else abs(diff) <= TOLERANCE
        rows.append(
            {
                "program": program,
                "line": name,
                "ledger_bytes": int(ledger),
                "compiled_bytes": int(got),
                "difference": None if diff is None else round(diff, 4),
                "within_tolerance": bool(ok),
                "explanation": holds + ("" if ok or not beyond else "; beyond 10 %: " + beyond),
            }
        )

    for program, prog in compiled["programs"].items():
        inputs = prog["inputs_bytes"]
        activations = acts[program]["peak"]
        rows_key = {"prefill": "prefill_rows", "long_prefill": "long_prefill_rows"}.get(program, "max_slots")
        rows_ = compiled["shapes"][rows_key]
        sampled = _sampler_bytes(rows_)
        line(
            program,
            "arguments",
            weights + kv + inputs,
            prog["arguments_bytes"],
            f"weights ledger {_u(weights)} + KV ledger (the state) {_u(kv)} + the step's inputs "
            f"{_u(inputs)} (not a ledger: counted from the abstract inputs)",
            "the parameters or the state are laid out differently from the ledgers' rules",
        )
        line(
            program,
            "temporaries",
            activations,
            prog["temporaries_bytes"],
            (
                f"activations ledger: the largest sublayer of a {acts['prefill']['tokens']}-token page "
                "step with its largest dense weight's f32 copy (made inside the loop iteration)"
                if program == "prefill"
                else f"activations ledger: the largest sublayer of a {acts[program]['tokens']}-token step "
                "with its largest dense weight's f32 copy"
            ),
            "XLA keeps more (or fewer) buffers live than the ledger's model of the program",
        )
        line(
            program,
            "outputs beside the donated state",
            sampled,
            prog["outputs_bytes"] - prog["aliased_bytes"],
            f"the sampler's results for {rows_} rows {_u(sampled)} (not a ledger: counted here)",
            "outputs other than the sampler's results",
        )
        line(
            program,
            "total",
            weights + kv + inputs + acts[program]["peak"] + sampled,
            prog["total_bytes"],
            "arguments + outputs - aliased + temporaries (the donated state is held once)",
            "see the lines above",
        )
    worst = max(p["total_bytes"] for p in compiled["programs"].values())
    total = worst + overhead
    return {
        "rows": rows,
        "per_device_total_bytes": total,
        "fits": total <= device_bytes,
        "note": "compiled per-device total = the larger program's total + the overhead ledger "
        f"({overhead / GIB:.2f} GiB: runtime, executables, allocator slack, which XLA's analysis does "
        "not see)",
    }


def _g(n: float) -> str:
    return f"{n / GIB:9.3f} GiB" if abs(n) >= GIB else f"{n / 2**20:9.3f} MiB"


def _u(n: float) -> str:
    return _g(n).strip()


def format_compiled(compiled: dict, comparison: dict, device_bytes: int) -> str:
    """The compiled proof as text: XLA's analysis beside the ledgers, line by line."""
    sh = compiled["shapes"]
    lines = [
        "",
        f"compiled proof: XLA:{compiled['backend'].upper()} memory analysis per device, mesh "
        f"{_mesh_text(compiled['mesh'])} on {compiled['devices']} fake CPU devices in "
        f"{compiled['processes']} process(es), Engram tables on {compiled['engram_tables']}, "
        f"{compiled['scheduler']} scheduler, impl {compiled['impl']}",
        f"  prefill: {sh['prefill_rows']} rows x {sh['prefill_chunk']}-token chunks ({sh['page_size']}-token "
        f"pages per loop iteration); decode: {sh['max_slots']} rows; state {sh['max_slots']} slots x "
        f"{sh['max_context']} tokens in {sh['num_pages']} pages",
    ]
    if "long_prefill" in compiled["programs"]:
        lines.append(
            f"  long_prefill: {sh['long_prefill_rows']} row(s) x {sh['long_prefill_chunk']}-token chunks "
            f"({sh['long_prefill_step']} tokens per loop iteration)"
        )
    for name, prog in compiled["programs"].items():
        lines.append(
            f"  {name:8s} arguments {_g(prog['arguments_bytes'])}  outputs {_g(prog['outputs_bytes'])}  "
            f"aliased {_g(prog['aliased_bytes'])}  temporaries {_g(prog['temporaries_bytes'])}  "
            f"total {_g(prog['total_bytes'])}  compiled in {prog['compile_seconds']:.0f} s"
        )
    lines.append("  ledgers vs compiled, per device:")
    for r in comparison["rows"]:
        diff = "   n/a" if r["difference"] is None else f"{100 * r['difference']:+6.1f} %"
        mark = "ok" if r["within_tolerance"] else "!!"
        lines.append(
            f"    {mark} {r['program']:8s} {r['line']:33s} ledger {_g(r['ledger_bytes'])}  compiled "
            f"{_g(r['compiled_bytes'])}  {diff}  ({r['explanation']})"
        )
    lines.append(
        f"  compiled total {_g(comparison['per_device_total_bytes'])} of {_g(device_bytes)} per device "
        f"-> {'fits' if comparison['fits'] else 'does NOT fit'} ({comparison['note']})"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------- subprocesses
def _mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_compile(
    model: str,
    mesh_sizes: dict[str, int],
    *,
    processes: int = 1,
    timeout_s: float = 7200,
    **kw,
) -> dict:
    """`compile_in_process` in `processes` fresh processes (python -m serving.planning.compile_proof) of
    devices/processes fake CPU devices each, joined by jax.distributed on localhost when more than
    one; process 0's result (every process compiles the same SPMD program; their analyses are
    checked equal). kw: compile_in_process's keywords. model: a preset name or a checkpoint dir."""
    devices = math.prod(mesh_sizes.values())
    if processes < 1 or devices % processes:
        raise CompileProofError(
            f"--compile-processes {processes} does not divide the mesh's {devices} devices"
        )
    spec = {"model": model, "mesh": mesh_sizes, **kw}
    port = _free_port() if processes > 1 else None
    procs = []
    logs = []
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for pid in range(processes):
            cmd = [sys.executable, "-m", "serving.planning.compile_proof", "--spec", json.dumps(spec)]
            cmd += ["--local-devices", str(devices // processes)]
            if processes > 1:
                cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
                cmd += ["--process-id", str(pid)]
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
            # Files, not pipes: a process blocked on a full pipe would hold its peers at their barrier.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=REPO))
        for pid, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise CompileProofError(f"compile process {pid} ran past {timeout_s:g} s") from None
            out, err = logs[pid]
            out.seek(0)
            err.seek(0)
            if proc.returncode != 0:
                tail = "\n".join(err.read().strip().splitlines()[-8:])
                raise CompileProofError(f"compile process {pid} failed (exit {proc.returncode}):\n{tail}")
            results.append(json.loads(out.read().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for out, err in logs:
            out.close()
            err.close()
    first = results[0]
    for pid, r in enumerate(results[1:], 1):
        for name, prog in r["programs"].items():
            a = {k: v for k, v in prog.items() if k != "compile_seconds"}
            b = {k: v for k, v in first["programs"][name].items() if k != "compile_seconds"}
            if a != b:
                raise CompileProofError(
                    f"process {pid}'s {name} analysis differs from process 0's: {a} vs {b}"
                )
    if processes > 1:
        for name in first["programs"]:
            first["programs"][name]["compile_seconds_per_process"] = [
                r["programs"][name]["compile_seconds"] for r in results
            ]
    return first


def prove(
    result: dict,
    model: str,
    *,
    processes: int = 1,
    scheduler: str = "memory",
    timeout_s: float = 7200,
) -> dict:
    """`ced-jax plan --compile`: compile the plan's recommended (or closest) mesh and Engram
    placement at its workload (`run_compile`) and add to the plan `result` (returned, updated):
    `compiled` (per program: arguments_bytes, outputs_bytes, aliased_bytes, temporaries_bytes,
    total_bytes per device, compile_seconds; and the compiled per_device_total_bytes and fits),
    `ledgers` (the four ledgers' per_device_total_bytes and fits), `comparison` (`compare`'s lines);
    `fits` becomes: the ledgers and the compiled programs both fit."""
    w = result["workload"]
    if w["dspark"]:
        raise CompileProofError(
            "--compile compiles the plain prefill and decode programs; the speculative ones "
            "(--dspark K) are not compiled here: plan with --dspark 0"
        )
    cand = result.get("recommended") or result["closest"]
    compiled = run_compile(
        model,
        cand["mesh"],
        processes=processes,
        timeout_s=timeout_s,
        rules=cand["rules"],
        engram_on_host=cand["engram_tables"] == "host",
        max_seqs=w["max_seqs"],
        context=w["context"],
        prefill_bucket=w["prefill_bucket"],
        page_size=w["page_size"],
        scheduler=scheduler,
    )
    device_bytes = result["hardware"]["device_memory_bytes"]
    comparison = compare(cand, compiled, device_bytes)
    programs = compiled.pop("programs")
    result["compiled"] = {
        **programs,
        **compiled,
        "per_device_total_bytes": comparison["per_device_total_bytes"],
        "fits": comparison["fits"],
        "total_note": comparison["note"],
    }
    result["ledgers"] = {"per_device_total_bytes": cand["per_device_total"], "fits": cand["fits"]}
    result["comparison"] = comparison["rows"]
    result["fits"] = bool(result["fits"] and comparison["fits"])
    return result


def format_proof(result: dict) -> str:
    """The text `plan --compile` prints after the plan."""
    compiled = dict(result["compiled"])
    compiled["programs"] = {k: compiled[k] for k in PROGRAMS if k in compiled}
    comparison = {
        "rows": result["comparison"],
        "per_device_total_bytes": compiled["per_device_total_bytes"],
        "fits": compiled["fits"],
        "note": compiled["total_note"],
    }
    return format_compiled(compiled, comparison, result["hardware"]["device_memory_bytes"])


def _config(model: str) -> ModelConfig:
    return preset(model) if model in PRESETS else ModelConfig.from_pretrained(model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m serving.planning.compile_proof", description=__doc__.split("\n")[0]
    )
    p.add_argument("--spec", required=True, help="JSON: model, mesh and compile_in_process keywords")
    p.add_argument("--local-devices", type=int, required=True, help="fake CPU devices of this process")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    args = p.parse_args(argv)
    spec = json.loads(args.spec)
    # Before anything initialises a backend: this process's devices are fake CPU devices.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.coordinator:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=300,
        )
    model, mesh = spec.pop("model"), spec.pop("mesh")
    if "programs" in spec:
        spec["programs"] = tuple(spec["programs"])
    result = compile_in_process(_config(model), mesh, **spec)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
