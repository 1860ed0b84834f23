"""`ced-jax plan`: the memory plan of a model on some devices (weights, activations, KV and overhead
per device; fits or not; a mesh), optionally proven by compiling the real programs."""

from __future__ import annotations

import json

from ced_cli.options import check_at_least


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="memory plan: weights, activations, KV and overhead per device; fits or not; a mesh "
        "(exit 0 fits, 1 does not fit)",
    )
    p.add_argument("--model", required=True, help="preset name (v41-flash, tiny) or checkpoint directory")
    p.add_argument("--devices", type=int, required=True, help="number of accelerators (all hosts)")
    p.add_argument("--device-memory", type=float, required=True, metavar="GIB", help="memory per device")
    p.add_argument(
        "--host-memory",
        type=float,
        metavar="GIB",
        help="host memory per host for the Engram tables' page cache (default: not limited: the tables "
        "are memory-mapped files, read from disk when cold)",
    )
    p.add_argument("--mesh", help="evaluate this mesh (data=D,expert=E,tensor=T) instead of recommending one")
    p.add_argument("--rules", choices=("ep_tp", "tp", "replicated", "dp_ep"), default="ep_tp")
    p.add_argument("--max-seqs", type=int, help="concurrent sequences (default: the server's max_slots)")
    p.add_argument("--context", type=int, help="tokens per sequence (default: the server's max_context)")
    p.add_argument(
        "--prefill-bucket", type=int, help="prefill chunk length (default: the server's largest bucket)"
    )
    p.add_argument("--page-size", type=int, help="tokens per KV page (default: the server's page_size)")
    p.add_argument(
        "--dspark",
        type=int,
        metavar="K",
        help="DSpark speculative decoding with K drafts per step, as `serve --dspark K`: adds the draft "
        "stages (replicated), each slot's draft rings and logits, and the K+1-token verify step "
        "(default: the server's, 0 = off)",
    )
    p.add_argument("--json", action="store_true", help="the full plan as JSON")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compiled proof: lower and compile the real prefill and decode programs of the recommended "
        "(or --mesh) layout from abstract inputs on as many fake CPU devices (no weights, no allocation; "
        "minutes to tens of minutes for v41-flash) and print XLA's per-device memory analysis beside "
        "the ledgers (exit 0 only if both fit)",
    )
    p.add_argument(
        "--compile-processes",
        type=int,
        default=1,
        metavar="P",
        help="--compile: spread the fake devices over P processes (jax.distributed on localhost), "
        "as on P hosts (default 1)",
    )
    p.add_argument(
        "--compile-scheduler",
        choices=("memory", "default"),
        default="memory",
        help="--compile: XLA:CPU's memory-minimising instruction scheduler (default), or its default "
        "one, which schedules for the host's threads and keeps every layer's weight copies live",
    )
    p.add_argument(
        "--compile-timeout", type=float, default=7200, metavar="S", help="--compile: seconds per compile run"
    )
    p.set_defaults(func=run)


def _check_compile_options(args) -> None:
    """The compiled proof's own options; the plan's values are checked by `Hardware` and `plan`, before
    anything slow."""
    check_at_least("--compile-processes", args.compile_processes, 1)
    check_at_least("--compile-timeout", args.compile_timeout, 1)
    if args.compile and args.devices % args.compile_processes:
        raise ValueError(
            f"--compile-processes {args.compile_processes} does not divide --devices {args.devices} "
            "(every process holds the same number of fake devices)"
        )


def run(args) -> int:
    from ced_jax import sharding
    from ced_jax.config import PRESETS, ModelConfig, preset
    from serving.planning.capacity import Hardware, format_plan, plan

    hardware = Hardware(args.devices, args.device_memory, args.host_memory)
    mesh = None if args.mesh is None else sharding.parse_mesh(args.mesh)
    _check_compile_options(args)
    cfg = preset(args.model) if args.model in PRESETS else ModelConfig.from_pretrained(args.model)
    workload = {  # what is not given here is a server's default (ServeConfig, through plan's defaults)
        name: value
        for name, value in (
            ("max_seqs", args.max_seqs),
            ("context", args.context),
            ("prefill_bucket", args.prefill_bucket),
            ("page_size", args.page_size),
            ("dspark", args.dspark),
        )
        if value is not None
    }
    result = plan(
        cfg,
        hardware,
        mesh=mesh,
        rules=args.rules,
        **workload,
    )
    text = None if args.json else format_plan(result)
    if args.compile:
        from serving.planning.compile_proof import format_proof, prove

        if text is not None:  # the plan first: the compile takes minutes
            print(text, flush=True)
        result = prove(
            result,
            args.model,
            processes=args.compile_processes,
            scheduler=args.compile_scheduler,
            timeout_s=args.compile_timeout,
        )
        text = None if args.json else format_proof(result)
    print(json.dumps(result, indent=2) if args.json else text)
    return 0 if result["fits"] else 1
