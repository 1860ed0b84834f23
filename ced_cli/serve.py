"""`ced-jax serve`: the gRPC server (and HTTP API, metrics) over a continuously batched engine; its
flags, shared by `ced-jax compile`, and the `ServeConfig` they build. Multi-host: process 0 serves and
schedules, the others follow it (serving.engine.multihost)."""

from __future__ import annotations

import argparse
import os
import sys

from ced_cli.options import (
    add_compilation_cache_options,
    add_impl_options,
    add_mesh_options,
    check_at_least,
    check_compilation_cache_options,
    check_mesh_and_hosts,
    check_processes,
    load_model,
    model_config,
    setup_distributed,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="gRPC server (ced.v1.InferenceService, health, reflection, Prometheus metrics)",
        description="Continuous batching over a static-shape paged KV cache; every program is compiled "
        "at start-up. SIGTERM stops admitting, lets streams finish for --grace-period, then exits 0.",
    )
    add_serve_options(p)
    p.set_defaults(func=run)


def _auto_context(args, values: dict) -> int:
    """--max-context auto (serving.planning.capacity.auto_max_context): from the model, the memory and
    --num-pages (`values`: the parsed serve flags, `config_values`)."""
    from serving.config import ServeConfig
    from serving.flags import named

    slots, page, pages = values["max_slots"], values["page_size"], values["num_pages"]
    # Checked here too, as auto divides by them before ServeConfig sees them.
    check_at_least(named(ServeConfig, "max_slots"), slots, 1)
    check_at_least(named(ServeConfig, "page_size"), page, 1)
    cfg = model_config(args.model)
    if cfg is None:  # loading reports it
        return ServeConfig().max_context
    if pages is not None:
        check_at_least(named(ServeConfig, "num_pages"), pages, 1)
        pool = pages * page // slots // page * page
        context = min(cfg.max_position_embeddings // page * page, pool)
        if context < page:
            raise ValueError(
                f"--max-context auto: --num-pages {pages} hold less than a page for each of "
                f"--max-slots {slots} sequences; give --max-context"
            )
        return context
    if args.coordinator is not None:
        if args.mesh is None and args.num_processes and args.num_processes > 1:
            raise ValueError("a multi-process run needs --mesh (e.g. --mesh expert=4,tensor=2)")
        check_processes(args)
        raise ValueError(
            "--max-context auto: a multi-process server does not size its context from each process's "
            "memory (every process must compile the same shapes); give --max-context"
        )
    import jax

    from ced_jax import sharding
    from serving.planning import capacity

    device = jax.local_devices()[0]
    device_bytes = None if device.platform == "cpu" else (device.memory_stats() or {}).get("bytes_limit")
    mesh = sharding.parse_mesh(args.mesh) if args.mesh else dict.fromkeys(sharding.MESH_AXES, 1)
    return capacity.auto_max_context(
        cfg, device_bytes=device_bytes, mesh=mesh, rules=args.rules,
        engram_on_host=args.engram_placement != "device", max_seqs=slots,
        prefill_bucket=values["prefill_buckets"][-1], page_size=page, dspark=values["dspark"],
    )  # fmt: skip


def serve_config(args):
    """The `ServeConfig` of the serve flags (shared by `serve` and `compile`), checked before anything
    slow: every value by ServeConfig and its nested configs (errors name field and flag), the key
    file, and the KV disk directory. auto (--max-context, --max-tokens-limit) is sized here first."""
    check_mesh_and_hosts(args)
    check_compilation_cache_options(args)
    from serving.config import ServeConfig
    from serving.flags import AUTO

    values = config_values(args)
    if values["max_context"] == AUTO:
        values["max_context"] = _auto_context(args, values)
    if values["max_tokens_limit"] == AUTO:
        values["max_tokens_limit"] = values["max_context"]
    # A request without max_tokens gets ServeConfig's default, within --max-tokens-limit; /metrics
    # listens on --host.
    values["default_max_tokens"] = min(ServeConfig().default_max_tokens, values["max_tokens_limit"])
    values["metrics_host"] = values["host"]
    config = ServeConfig(**values)  # validates every value before anything is loaded
    # Before the model loads: a busy, unwritable or foreign directory fails at once.
    if config.kv_disk_dir is not None:
        from serving.scheduling.kv_tiers import DiskTier

        try:
            DiskTier.check_directory(config.kv_disk_dir)
        except RuntimeError as e:
            raise ValueError(f"--kv-disk-dir: {e}") from None
    return config


def _dest(flag) -> str:
    """The argparse attribute of a flag: its name's, e.g. max_slots for --max-slots."""
    return flag.name[2:].replace("-", "_")


def add_config_flags(groups: dict) -> None:
    """One flag per `serving.flags.Flag` declared on a config field (fields of ServeConfig and of the
    configs nested in it, `serving.config.serve_flags`): its name, help, section, metavar, choices
    from the declaration; its type and default from the field, unless it declares a default (text)
    or a parse, whose text `config_values` parses."""
    from serving.config import serve_flags

    for _, field, flag in serve_flags():
        kw = {"help": flag.help, "metavar": flag.metavar, "choices": flag.choices}
        kind = field.type.replace(" | None", "")
        if flag.repeatable:
            kw["action"] = "append"
        if flag.parse is not None:
            kw["default"] = flag.command_default  # None: not given, the field's default
        elif kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if field.default else "store_true"
            kw["default"] = field.default
        else:
            kw["type"] = {"int": int, "float": float, "str": str}[kind]
            # A command default is text, typed by argparse like the flag's.
            kw["default"] = field.default if flag.command_default is None else flag.command_default
        groups[flag.group].add_argument(flag.name, **{k: v for k, v in kw.items() if v is not None})


def config_values(args) -> dict:
    """The `ServeConfig` fields the serve flags set (`add_config_flags`), each flag's text parsed by
    its `parse` (a ValueError names field and flag; a flag with a parse not given leaves the field's
    default, and of two flags of one field one may be given). A nested config (http_limits,
    http_image_fetch, http_files) is ServeConfig's default with its flags' values, built (and so
    checked) here. max_context and max_tokens_limit may be AUTO, for `serve_config` to size."""
    import dataclasses

    from serving.config import ServeConfig, serve_flags

    values, nested, given = {}, {}, {}
    for path, _, flag in serve_flags():
        value = getattr(args, _dest(flag))
        if flag.parse is not None and value is None:
            continue
        if path in given:
            raise ValueError(f"{path[-1]} ({given[path]} / {flag.name}): give one or the other")
        given[path] = flag.name
        if flag.parse is not None:
            try:
                value = flag.parse(value)
            except ValueError as e:
                raise ValueError(f"{path[-1]} ({flag.name}): {e}") from None
        fields = values if len(path) == 1 else nested.setdefault(path[0], {})
        fields[path[-1]] = value
        fields.update(flag.also)
    defaults = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    for name, fields in nested.items():
        values[name] = dataclasses.replace(defaults[name], **fields)
    return values


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """The flags of `serve`, shared by `compile` (the same flags build the same programs): each
    declared on the config field it sets (serving/config.py)."""
    p.add_argument("model", help="preset name (tiny) or checkpoint directory")
    from serving.flags import FLAG_GROUPS

    add_config_flags({name: p.add_argument_group(name) for name in FLAG_GROUPS})
    add_impl_options(p)
    add_mesh_options(p)
    add_compilation_cache_options(p)


def run(args) -> int:
    """`ced-jax serve MODEL`: bind the ports, load, compile the engine's programs, serve gRPC until
    SIGTERM. Options are checked and ports bound before anything slow (JAX is imported by the loader)."""
    from serving.server import serve

    config = serve_config(args)
    chunk = config.prefill_buckets[-1]
    cluster = serve_cluster(args)
    if cluster is not None and not cluster.is_leader:
        return serve_follower(args, config, cluster)

    def load():  # called by serve once every port is bound
        from serving.engine.jax_engine import JaxEngine, ModelTokenizer

        model = load_model(args)
        if cluster is not None and getattr(model, "vision", None) is not None:
            raise ValueError("multi-host serve: a model with a vision tower is not supported yet")
        engine = JaxEngine(model, config, cluster=cluster)
        rows = "/".join(map(str, config.prefill_rows))
        print(
            f"ced-jax: compiling prefill ({chunk}-token chunks, {rows} rows"
            + (
                f"; long prompts {config.long_prefill_chunk}-token chunks, 1 row"
                if config.long_prefill_chunk
                else ""
            )
            + f") and decode ({config.max_slots} slots"
            + (f", DSpark widths {list(engine.dspark_widths)}" if config.dspark else "")
            + ") ...",
            flush=True,
        )
        return engine, ModelTokenizer(model)

    if cluster is None:
        return serve(config, load)
    rc = 1
    try:
        rc = serve(config, load, cluster=cluster)
        return rc
    finally:
        cluster.stop_followers()
        n = max(cluster.calls_sent, 1)
        print(
            f"ced-jax: handed {cluster.calls_sent} engine calls to the other processes "
            f"({cluster.bytes_sent / n:.0f} bytes, {cluster.send_seconds / n * 1e3:.3f} ms each); "
            f"{cluster.compile_barriers} compile barriers, {cluster.barrier_seconds:.1f} s waiting there",
            flush=True,
        )
        if cluster.lost_peer is not None:
            exit_without_runtime_teardown(rc)


def exit_without_runtime_teardown(rc: int) -> None:
    """Ends a leader whose peer died. Python's finalization would destroy the device client, which
    joins its worker threads, and one of them waits in a collective whose peer is gone (a gloo
    all-gather, seen holding exit past 3 minutes); nothing is left to save, so the process ends here."""
    print("ced-jax: a process of the mesh is gone: exiting without tearing down the device runtime")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def serve_cluster(args):
    """The multi-host `Cluster` of a `serve` or `compile` run with --coordinator flags, else None."""
    if args.coordinator is None and args.num_processes is None and args.process_id is None:
        return None
    if args.mesh is None:
        raise ValueError("a multi-process run needs --mesh (e.g. --mesh expert=4,tensor=2)")
    setup_distributed(args, recoverable=True)
    from serving.engine.multihost import Cluster

    return Cluster()


def serve_follower(args, config, cluster) -> int:
    """A process other than 0 of a multi-host `serve`: the model and the engine's state on its devices,
    then the leader's calls until it stops (serving.engine.multihost)."""
    from serving.engine.jax_engine import JaxEngine
    from serving.engine.multihost import follow

    model = load_model(args)
    engine = JaxEngine(model, config)  # the same Engine (state, programs, history) as the leader's
    print(f"ced-jax: process {cluster.process_id} of {cluster.num_processes} following process 0", flush=True)
    rc = follow(engine.engine, cluster)
    print(
        f"ced-jax: process {cluster.process_id}: stopped by process 0; {cluster.compile_barriers} compile "
        f"barriers, {cluster.barrier_seconds:.1f} s waiting there",
        flush=True,
    )
    return rc
