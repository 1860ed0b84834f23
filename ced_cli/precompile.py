"""`ced-jax compile`: the server's start-up without serving, so that a later `ced-jax serve` with the
same flags finds every program in the persistent compilation cache."""

from __future__ import annotations

from ced_cli.options import load_model
from ced_cli.serve import add_serve_options, serve_cluster, serve_config, serve_follower


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="compile every program `serve` would for these flags into the compilation cache, then exit",
        description="Builds the programs a `ced-jax serve` with the same flags builds at start-up (every "
        "prefill and decode bucket, table width, DSpark width and image variant) into the persistent "
        "compilation cache, prints each with its time and the cache's size, and exits without serving. "
        "A server started afterwards with the same flags and cache compiles nothing. On a multi-host "
        "mesh run it on every process, as serve.",
    )
    add_serve_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """`ced-jax compile MODEL [serve flags]`: the server's start-up without serving. Every program the
    server would build for these flags goes into the persistent compilation cache; a table of them
    (fresh compiles, cache loads, seconds) and the cache's size are printed. Multi-host: every
    process runs it, as `serve` (process 0 drives the others' programs, as it does there)."""
    import time

    config = serve_config(args)
    if args.no_compilation_cache:
        raise ValueError("--no-compilation-cache: compile writes the compilation cache; drop the flag")
    cluster = serve_cluster(args)
    if cluster is not None and not cluster.is_leader:
        return serve_follower(args, config, cluster)
    from ced_jax import compile_cache
    from serving.engine.jax_engine import JaxEngine

    started = time.perf_counter()
    try:
        model = load_model(args)
        loaded = time.perf_counter()
        engine = JaxEngine(model, config, cluster=cluster)
        engine.warmup()
    finally:
        if cluster is not None:
            cluster.stop_followers()
    done = time.perf_counter()
    report = engine.warmup_report
    width = max(len(e.program) for e in report)
    print(f"{'program':<{width}}  compiled  from cache  compile s  load s  wall s")
    for e in report:
        print(
            f"{e.program:<{width}}  {e.compiled:8d}  {e.from_cache:10d}  {e.compile_seconds:9.1f}  "
            f"{e.load_seconds:6.1f}  {e.seconds:6.1f}"
        )
    entries, size = compile_cache.cache_bytes()
    compiled = sum(e.compiled for e in report)
    cached = sum(e.from_cache for e in report)
    print(
        f"ced-jax compile: {len(report)} program calls, {compiled} executables compiled and {cached} loaded "
        f"from the cache in {done - loaded:.1f} s (model load {loaded - started:.1f} s); cache "
        f"{compile_cache.current_dir()}: {entries} entries, {size / 2**20:.1f} MiB",
        flush=True,
    )
    return 0
