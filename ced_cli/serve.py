"""`ced-jax serve`: the gRPC server (and HTTP API, metrics) over a continuously batched engine; its
flags, shared by `ced-jax compile`, and the `ServeConfig` they build. Multi-host: process 0 serves and
schedules, the others follow it (serving.engine.multihost)."""

from __future__ import annotations

import argparse

from ced_cli.options import (
    add_compilation_cache_options,
    add_impl_options,
    add_mesh_options,
    add_prefill_mode_option,
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


def _int_or_auto(flag: str):
    """An argparse type: an int, or the string "auto" (resolved by _check_serve_options)."""

    def parse(text: str):
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text!r}") from None

    parse.__name__ = flag  # argparse names the type in its error
    return parse


def _auto_context(args) -> int:
    """--max-context auto (serving.planning.capacity.auto_max_context): from the model, the memory and
    --num-pages."""
    page = args.page_size
    check_at_least("--max-slots", args.max_slots, 1)
    check_at_least("--page-size", page, 1)
    cfg = model_config(args.model)
    if cfg is None:
        return _serve_defaults().max_context
    if args.num_pages is not None:
        check_at_least("--num-pages", args.num_pages, 1)
        pool = args.num_pages * page // args.max_slots // page * page
        context = min(cfg.max_position_embeddings // page * page, pool)
        if context < page:
            raise ValueError(
                f"--max-context auto: --num-pages {args.num_pages} hold less than a page for each of "
                f"--max-slots {args.max_slots} sequences; give --max-context"
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
        engram_on_host=args.engram_placement != "device", max_seqs=args.max_slots,
        prefill_bucket=args.prefill_chunk, page_size=page, dspark=args.dspark,
    )  # fmt: skip


def _check_serve_options(args) -> None:
    """The hand-written shape flags, by flag, before ServeConfig is built: `auto` is resolved here,
    first (from --max-slots and --page-size, checked for it), and the lists are parsed and stated
    against --max-slots and --max-context. The values of generated flags are ServeConfig's to check."""
    check_mesh_and_hosts(args)
    if args.max_context == "auto":
        args.max_context = _auto_context(args)
    if args.max_tokens_limit == "auto":
        args.max_tokens_limit = args.max_context
    at_least = (
        ("--max-slots", args.max_slots, 1),
        ("--page-size", args.page_size, 1),
        ("--max-context", args.max_context, 1),
        ("--num-pages", args.num_pages, 1),
        ("--prefill-chunk", args.prefill_chunk, 1),
        ("--max-tokens-limit", args.max_tokens_limit, 1),
    )
    for flag, value, minimum in at_least:
        check_at_least(flag, value, minimum)
    page = args.page_size
    if args.max_context % page:
        raise ValueError(f"--max-context {args.max_context} must be a multiple of --page-size {page}")
    if args.prefill_chunk % page:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk} must be a multiple of --page-size {page}")
    rows = _prefill_rows(args)
    if rows is not None and (list(rows) != sorted(set(rows)) or rows[0] < 1 or rows[-1] > args.max_slots):
        raise ValueError(
            f"--prefill-rows must be ascending row counts in 1..--max-slots ({args.max_slots}), "
            f"got {args.prefill_rows}"
        )
    if rows is not None and len(rows) > 1 and args.batch_invariant:
        raise ValueError(
            f"--prefill-rows {args.prefill_rows}: several prefill sizes break --batch-invariant (a "
            "request's output would depend on what is prefilled beside it); give one count, or add "
            "--no-batch-invariant"
        )
    _context_buckets(args)


def _context_buckets(args) -> tuple[int, ...] | None:
    """--decode-context-buckets as a tuple of token counts ending at --max-context (None: not given)."""
    if args.decode_context_buckets is None:
        return None
    try:
        widths = tuple(int(x) for x in args.decode_context_buckets.split(","))
    except ValueError:
        raise ValueError(
            "--decode-context-buckets must be comma-separated token counts such as 8192,65536, got "
            f"{args.decode_context_buckets!r}"
        ) from None
    page = args.page_size
    if list(widths) != sorted(set(widths)) or widths[0] < 1 or any(w % page for w in widths):
        raise ValueError(
            f"--decode-context-buckets must be ascending multiples of --page-size {page}, got "
            f"{args.decode_context_buckets}"
        )
    if widths[-1] > args.max_context:
        raise ValueError(
            f"--decode-context-buckets {args.decode_context_buckets}: at most --max-context "
            f"{args.max_context}"
        )
    return widths if widths[-1] == args.max_context else (*widths, args.max_context)


def _prefill_rows(args) -> tuple[int, ...] | None:
    """--prefill-rows as a tuple of ints (None: not given)."""
    if args.prefill_rows is None:
        return None
    try:
        return tuple(int(x) for x in args.prefill_rows.split(","))
    except ValueError:
        raise ValueError(
            f"--prefill-rows must be comma-separated row counts such as 4 or 2,4, got {args.prefill_rows!r}"
        ) from None


def _serve_defaults():
    """ServeConfig(): the one declaration of a server's shapes and limits and their defaults."""
    from serving.config import ServeConfig

    return ServeConfig()


def _http_models(args):
    """ModelNames with the --model-alias values (each NAME or NAME=thinking|non-thinking)."""
    from serving.model_names import ModelNames, parse_alias

    try:
        return ModelNames(extra_aliases=tuple(parse_alias(v) for v in args.model_alias or ()))
    except ValueError as e:
        raise ValueError(f"--model-alias: {e}") from None


def _image_fetch(args, fetch):
    """`fetch` (ServeConfig.http_image_fetch) with the hosts of --allow-image-urls: one flag for two
    fields, whether URLs are fetched at all and from which hosts."""
    import dataclasses

    if args.allow_image_urls is None:
        return fetch
    hosts = tuple(h.strip() for h in args.allow_image_urls.split(","))
    if not all(hosts):
        raise ValueError(f"--allow-image-urls: expected HOST[,HOST...], got {args.allow_image_urls!r}")
    try:
        return dataclasses.replace(fetch, allow_image_urls=True, allowed_hosts=hosts)
    except ValueError as e:
        raise ValueError(f"--allow-image-urls: {e}") from None


def _check_port_option(option: str, port: int, off: int | None = None) -> None:
    if port != off and not 0 <= port <= 65535:
        also = "" if off is None else f", or {off} (off)"
        raise ValueError(f"{option} must be in 0..65535 (0: any free port){also}, got {port}")


def serve_config(args):
    """The `ServeConfig` of the serve flags (shared by `serve` and `compile`), checked before anything
    slow: every number, key file, port and the KV disk directory."""
    _check_serve_options(args)
    check_compilation_cache_options(args)
    from serving.config import ServeConfig
    from serving.tenants import ApiKeys

    api_keys = None
    if args.api_key_file is not None and args.api_key is not None:
        raise ValueError("--api-key and --api-key-file: give one or the other")
    if args.api_key_file is not None:
        try:
            api_keys = ApiKeys.load(args.api_key_file)
        except ValueError as e:
            raise ValueError(f"--api-key-file {e}") from None
    if args.api_key is not None:
        try:
            api_keys = ApiKeys.parse([args.api_key], source="--api-key")
        except ValueError as e:
            raise ValueError(str(e).replace("line 1: ", "")) from None
    _check_port_option("--port", args.port)
    _check_port_option("--metrics-port", args.metrics_port, off=-1)
    if args.http_port != 0:  # 0 (or -1) turns the HTTP API off
        _check_port_option("--http-port", args.http_port, off=-1)
    values = config_values(args)
    values["http_image_fetch"] = _image_fetch(args, values["http_image_fetch"])
    chunk = args.prefill_chunk
    config = ServeConfig(
        **values,
        max_context=args.max_context,
        prefill_buckets=(chunk,),
        prefill_rows=_prefill_rows(args),  # None: ServeConfig's default for these shapes
        decode_context_buckets=_context_buckets(args),  # likewise
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(_serve_defaults().default_max_tokens, args.max_tokens_limit),
        prefill_mode=args.prefill_mode,
        api_keys=api_keys,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        metrics_host=args.host,
        http_port=None if args.http_port <= 0 else args.http_port,
        http_models=_http_models(args),
    )  # validates every value before anything is loaded
    # Before the model loads: a busy, unwritable or foreign directory fails at once.
    if config.kv_disk_dir is not None:
        from serving.scheduling.kv_tiers import DiskTier

        try:
            DiskTier.check_directory(config.kv_disk_dir)
        except RuntimeError as e:
            raise ValueError(f"--kv-disk-dir: {e}") from None
    return config


def add_config_flags(groups: dict) -> None:
    """One flag per config field that declares one (`serving.flags.Flag`; fields of ServeConfig and of
    the configs nested in it, `serving.config.serve_flags`): its name, help, section and metavar from the
    declaration, its type and default from the field; the value lands under the field's path, e.g.
    "max_slots" or "http_files.ttl_s" (`config_values`)."""
    from serving.config import serve_flags

    for path, field, flag in serve_flags():
        kind = field.type.replace(" | None", "")
        kw = {"dest": ".".join(path), "default": field.default, "help": flag.help}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if field.default else "store_true"
        else:
            kw["type"] = {"int": int, "float": float, "str": str}[kind]
            # argparse would spell a dotted dest; the flag's own name reads as it always did.
            kw["metavar"] = flag.metavar or flag.name[2:].replace("-", "_").upper()
        groups[flag.group].add_argument(flag.name, **kw)


def config_values(args) -> dict:
    """The `ServeConfig` fields the serve flags set directly (`add_config_flags`); a nested config
    (http_limits, http_image_fetch, http_files) is ServeConfig's default with its flags' values, built
    (and so checked) here."""
    import dataclasses

    from serving.config import ServeConfig, serve_flags

    values, nested = {}, {}
    for path, _, _ in serve_flags():
        value = getattr(args, ".".join(path))
        if len(path) == 1:
            values[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1]] = value
    defaults = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    for name, fields in nested.items():
        values[name] = dataclasses.replace(defaults[name], **fields)
    return values


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """The flags of `serve`, shared by `compile` (the same flags build the same programs)."""
    p.add_argument("model", help="preset name (tiny) or checkpoint directory")
    from serving.flags import ADMISSION, FLAG_GROUPS, IMAGES, SCHEDULING, SERVER, SHAPES, TENANTS

    serve = _serve_defaults()  # every default below is ServeConfig's (serving/config.py)
    groups = {name: p.add_argument_group(name) for name in FLAG_GROUPS}
    add_config_flags(groups)
    # The flags below are not generated from a field: each sets a value in a form of its own ("auto"
    # sized from the model and memory, a list checked against other flags, an "off" port), sets
    # several fields together, or is one declaration shared with other commands.
    g = groups[SHAPES]
    # auto: sized from the model, the device memory and other flags (_auto_context), before ServeConfig.
    g.add_argument(
        "--max-context",
        type=_int_or_auto("--max-context"),
        default="auto",
        help="prompt + generated tokens per request; auto: the largest the KV pool holds for --max-slots "
        "sequences (an accelerator's memory to 90 %% after weights and activations, on CPU 256 MiB of KV, "
        "or --num-pages), at most the model's own context",
    )
    # One chunk length: ServeConfig.prefill_buckets is a tuple of them (this command compiles one).
    g.add_argument(
        "--prefill-chunk", type=int, default=max(serve.prefill_buckets), help="prompt tokens per prefill call"
    )
    # Lists, parsed here and checked against --max-slots / --max-context (which the buckets end with).
    g.add_argument(
        "--prefill-rows",
        help="requests prefilled together: the row counts of the compiled prefill programs, ascending "
        "(e.g. 4 or 2,4; default: min(4, --max-slots), and 1 too with --no-batch-invariant); one count "
        "keeps prefix-cache hits bit-identical to cold runs on XLA:CPU, several (only with "
        "--no-batch-invariant) trade that for less padding",
    )
    g.add_argument(
        "--decode-context-buckets",
        metavar="TOKENS",
        help="page-table widths of the compiled prefill and decode programs, in tokens, ascending "
        "(e.g. 8192,65536; --max-context is added last): a step reads its rows' page tables only up "
        "to the smallest width that holds its longest row, so its cost follows the context in use, "
        "not --max-context (same tokens at every width). Default: 8192 and x8 from there below "
        "--max-context; each width is another set of compiled programs",
    )
    g = groups[SCHEDULING]
    # One declaration with `logits` and `generate` (ced_cli.options), whose default differs.
    add_prefill_mode_option(g, serve.prefill_mode, per_request=True)
    g = groups[ADMISSION]
    # auto: --max-context; also bounds ServeConfig.default_max_tokens (serve_config).
    g.add_argument(
        "--max-tokens-limit",
        type=_int_or_auto("--max-tokens-limit"),
        default="auto",
        help="largest accepted max_tokens; auto: --max-context",
    )
    g = groups[TENANTS]
    # Both build ServeConfig.api_keys (a key, or a file of keys and tenant names); one or the other.
    g.add_argument(
        "--api-key",
        help="require this API key on every call (gRPC metadata or HTTP header: authorization: Bearer KEY, "
        "or x-api-key: KEY); for several keys or named tenants use --api-key-file",
    )
    g.add_argument(
        "--api-key-file",
        help="require an API key on every call (authorization: Bearer KEY, or x-api-key: KEY); "
        "the file has one key per line, optionally followed by a name (the tenant's identity)",
    )
    g = groups[SERVER]
    # The command listens on the well-known ports, and -1 (or 0 for HTTP) turns one off (None in the
    # config); ServeConfig's own default (0, any free port) suits servers started in-process (tests,
    # benchmarks), which must not collide.
    g.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    g.add_argument(
        "--metrics-port", type=int, default=9464, help="Prometheus /metrics port (0: any free, -1: off)"
    )
    g.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="HTTP API port: OpenAI Chat Completions / Completions / Responses and Anthropic Messages, as "
        "DeepSeek's hosted API (0 or -1: off)",
    )
    # Repeatable, each parsed into an alias of ServeConfig.http_models.
    g.add_argument(
        "--model-alias",
        action="append",
        help="accept another model name on the HTTP API: NAME, or NAME=thinking / NAME=non-thinking to "
        "force the mode (repeatable; deepseek-v4-flash, deepseek-chat, deepseek-reasoner, ... by default)",
    )
    g = groups[IMAGES]
    # Two fields of http_image_fetch: whether URLs are fetched, and from which hosts (_image_fetch).
    g.add_argument(
        "--allow-image-urls",
        metavar="HOST[,HOST...]",
        help="HTTP API: fetch image URLs from these hosts (host or host:port); default: URLs are refused",
    )
    add_impl_options(p)
    add_mesh_options(p)
    add_compilation_cache_options(p)


def run(args) -> int:
    """`ced-jax serve MODEL`: bind the ports, load, compile the engine's programs, serve gRPC until
    SIGTERM. Options are checked and ports bound before anything slow (JAX is imported by the loader)."""
    from serving.server import serve

    config = serve_config(args)
    chunk = args.prefill_chunk
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
    try:
        return serve(config, load, cluster=cluster)
    finally:
        cluster.stop_followers()
        n = max(cluster.calls_sent, 1)
        print(
            f"ced-jax: handed {cluster.calls_sent} engine calls to the other processes "
            f"({cluster.bytes_sent / n:.0f} bytes, {cluster.send_seconds / n * 1e3:.3f} ms each); "
            f"{cluster.compile_barriers} compile barriers, {cluster.barrier_seconds:.1f} s waiting there",
            flush=True,
        )


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
