"""Kernel launches per step: what XLA's compiled decode and prefill programs run, counted.

    python bench/launches.py MODEL [--programs decode prefill] [--layers N] [--json OUT]

MODEL is a preset (tiny, v41-flash) or a checkpoint directory's config (bench/configs/mid). The
programs are the server's (`ced_jax.engine.programs.Programs`), compiled from abstract inputs on one CPU
device as `ced-jax plan --compile` does (`serving.planning.compile_proof`): no weights are read. `--layers N`
keeps the first N layers (a 40-layer v41-flash program takes many CPU minutes to compile; per-layer
counts do not need them all).

Counted, in the optimised HLO reachable from the entry computation: every instruction that runs
as its own kernel (a fusion, a custom call, a copy, a sort, ...; not parameters, constants, tuples,
bitcasts), through calls, conditionals (every branch) and while loops. "static" counts each once;
"per step" multiplies a loop's body by its known trip count (what a GPU would launch). Layers are
told apart by the `layer{i}` scope the model opens for each (`ced_jax.model.forward`); what XLA adds
without metadata inside a loop or call (its counter, copies) goes to the layer the rest of it names.
"mHC mixing per step" counts the kernels of the mixing sites (`ced_jax.model.layers.mhc.hc_mixes`, its
Sinkhorn loop's counters included): what impl=pallas runs as one kernel per site instead.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Instructions that are not a kernel of their own on XLA's backends.
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency",
}  # fmt: skip
CONTROL = {"call", "while", "conditional"}
HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
LAYER = re.compile(r"/layer(\d+)/")
# The mHC mixing (`ced_jax.model.layers.mhc.hc_mixes`, its own jit, so its ops carry this op_name): what the
# Pallas kernel of impl=pallas runs as one kernel per site.
MHC = "jit(hc_mixes)/"


@dataclass
class Instruction:
    name: str
    opcode: str
    text: str


@dataclass
class Counts:
    static: int = 0
    per_step: int = 0
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    by_layer: collections.Counter = field(default_factory=collections.Counter)
    mhc_per_step: int = 0  # kernels of the mHC mixing (MHC), its loops' counters included
    unknown_trip_counts: int = 0


def _opcode(rest: str) -> str | None:
    """The opcode after an instruction's `= `: its result type (maybe a parenthesised tuple) first."""
    end = rest.find(" ")
    if rest.startswith("("):
        depth = 0
        for end, ch in enumerate(rest):  # noqa: B007 (end is read after the loop)
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        end += 1
    m = re.match(r"\s*([\w\-]+)\(", rest[end:])
    return m.group(1) if m else None


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations by name and the entry's name, from `compiled.as_text()`."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None or " = " not in line:
            continue
        lhs, rest = line.split(" = ", 1)
        opcode = _opcode(rest)
        if opcode:
            name = lhs.replace("ROOT", "").strip().lstrip("%")
            computations[current].append(Instruction(name, opcode, line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _kind(ins: Instruction) -> str:
    if ins.opcode == "fusion":
        return re.sub(r"(\.\d+)+$", "", ins.name)
    if ins.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', ins.text)
        return f"custom-call:{m.group(1) if m else '?'}"
    return ins.opcode


def _callees(ins: Instruction) -> tuple[list[str], int | None]:
    """The computations a control instruction runs and how many times per run (None: unknown)."""
    if ins.opcode == "call":
        return re.findall(r"to_apply=%?([\w.\-]+)", ins.text), 1
    if ins.opcode == "conditional":
        m = re.search(r"branch_computations=\{([^}]*)\}", ins.text)
        names = [s.strip().lstrip("%") for s in m.group(1).split(",")] if m else []
        names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", ins.text)
        return names, 1
    body = re.search(r"body=%?([\w.\-]+)", ins.text).group(1)
    cond = re.search(r"condition=%?([\w.\-]+)", ins.text).group(1)
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.text)
    return [body, cond], int(trips.group(1)) if trips else None


def _layer(ins: Instruction) -> int | None:
    m = LAYER.search(ins.text)
    return int(m.group(1)) if m else None


def count_launches(text: str) -> Counts:
    computations, entry = parse_hlo(text)
    counts = Counts()
    dominant: dict[str, int | None] = {}

    def layer_of(name: str, depth: int = 0) -> int | None:
        """The layer most of a computation's instructions (callees included) name: what its loop
        counters and copies, which XLA adds without metadata, belong to."""
        if name not in dominant:
            if depth > 64:
                raise ValueError(f"computation nesting past 64 at {name}")
            seen: collections.Counter = collections.Counter()
            for ins in computations[name]:
                if ins.opcode in CONTROL:
                    seen.update(layer_of(c, depth + 1) for c in _callees(ins)[0])
                else:
                    seen[_layer(ins)] += 1
            seen.pop(None, None)
            dominant[name] = seen.most_common(1)[0][0] if seen else None
        return dominant[name]

    mhc_computation: dict[str, bool] = {}

    def in_mhc(name: str) -> bool:
        """Whether most instructions of a computation (callees included) are the mHC mixing's."""
        if name not in mhc_computation:
            votes = collections.Counter(
                in_mhc(c) if ins.opcode in CONTROL else MHC in ins.text
                for ins in computations[name]
                for c in (_callees(ins)[0] if ins.opcode in CONTROL else [None])
            )
            mhc_computation[name] = votes[True] > votes[False]
        return mhc_computation[name]

    def walk(name: str, times: int, inherited: int | None, depth: int = 0, mhc: bool = False) -> None:
        if depth > 64:
            raise ValueError(f"computation nesting past 64 at {name}")
        here = inherited if name == entry else (layer_of(name) if layer_of(name) is not None else inherited)
        for ins in computations[name]:
            if ins.opcode in CONTROL:
                callees, trips = _callees(ins)
                if trips is None:
                    counts.unknown_trip_counts += 1
                for callee in callees:
                    walk(callee, times * (trips or 1), _layer(ins) or here, depth + 1, mhc or in_mhc(callee))
                continue
            if ins.opcode in FREE:
                continue
            counts.static += 1
            counts.per_step += times
            counts.by_kind[_kind(ins)] += times
            if mhc or MHC in ins.text:
                counts.mhc_per_step += times
            layer = _layer(ins)
            counts.by_layer[layer if layer is not None else (here if here is not None else -1)] += times

    walk(entry, 1, None)
    return counts


def _config(model: str, layers: int | None):
    from serving.planning.compile_proof import _config as model_config

    cfg = model_config(model)
    if layers is None or layers >= cfg.num_layers:
        return cfg
    keep = lambda ids: tuple(i for i in ids if i < layers)
    return cfg.replace(
        num_layers=layers,
        compress_ratios=cfg.compress_ratios[:layers],
        kv_source_layer_ids=keep(cfg.kv_source_layer_ids),
        index_source_layer_ids=keep(cfg.index_source_layer_ids),
        engram_layer_ids=keep(cfg.engram_layer_ids),
        engram_num_embeddings=tuple(
            n for i, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, strict=True) if i < layers
        ),
        candidate_source_layer_id=(
            cfg.candidate_source_layer_id if cfg.candidate_source_layer_id < layers else -1
        ),
        dspark_target_layer_ids=(),
        num_nextn_predict_layers=0,
    )


def measure(
    model: str, *, programs, layers, max_seqs, context, prefill_bucket, page_size, hlo_dir=None
) -> dict:
    import jax

    from serving.planning.compile_proof import compile_in_process

    cfg = _config(model, layers)
    texts: dict[str, str] = {}
    result = compile_in_process(
        cfg,
        {"data": 1, "expert": 1, "tensor": 1},
        engram_on_host=False,
        max_seqs=max_seqs,
        context=context,
        prefill_bucket=prefill_bucket,
        page_size=page_size,
        programs=tuple(programs),
        on_compiled=lambda name, compiled: texts.__setitem__(name, compiled.as_text()),
    )
    out = {
        "model": model,
        "layers": cfg.num_layers,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "shapes": result["shapes"],
        "programs": {},
    }
    for name in programs:
        if hlo_dir is not None:
            Path(hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(hlo_dir) / f"{name}.hlo.txt").write_text(texts[name])
        c = count_launches(texts[name])
        in_layers = [c.by_layer[i] for i in range(cfg.num_layers)]
        out["programs"][name] = {
            "compile_s": result["programs"][name].get("compile_seconds"),
            "static": c.static,
            "per_step": c.per_step,
            "per_layer": in_layers,
            "per_layer_mean": sum(in_layers) / max(1, len(in_layers)),
            "outside_layers": c.by_layer[-1],
            "mhc_per_step": c.mhc_per_step,
            "unknown_trip_counts": c.unknown_trip_counts,
            "top_kinds": c.by_kind.most_common(15),
        }
    return out


def format_table(out: dict) -> str:
    lines = [
        f"{out['model']} ({out['layers']} layers), {out['backend']}, jax {out['jax']}",
        "| program | compile s | kernels (static) | kernels per step | per layer (mean) | outside layers "
        "| mHC mixing per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in out["programs"].items():
        compile_s = "?" if p["compile_s"] is None else f"{p['compile_s']:.1f}"
        lines.append(
            f"| {name} | {compile_s} | {p['static']} | {p['per_step']} | {p['per_layer_mean']:.0f} "
            f"| {p['outside_layers']} | {p['mhc_per_step']} |"
        )
    for name, p in out["programs"].items():
        top = ", ".join(f"{k} {n}" for k, n in p["top_kinds"])
        lines.append(f"- {name} per layer: {p['per_layer']}; top kinds per step: {top}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--programs", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--layers", type=int, help="keep only the first N layers")
    p.add_argument("--max-seqs", type=int, default=8, help="decode rows (default 8)")
    p.add_argument("--context", type=int, default=4096, help="context per slot (default 4096)")
    p.add_argument("--prefill-bucket", type=int, default=64, help="prefill tokens per row (default 64)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--hlo-dir", type=Path, help="also write each compiled program's HLO text here")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    out = measure(
        args.model,
        programs=args.programs,
        layers=args.layers,
        max_seqs=args.max_seqs,
        context=args.context,
        prefill_bucket=args.prefill_bucket,
        page_size=args.page_size,
        hlo_dir=args.hlo_dir,
    )
    print(format_table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
