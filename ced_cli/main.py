"""`ced-jax` command line: describe, logits, generate, serve, client, plan, convert.

`logits` and `generate` run on one device, or with `--mesh data=D,expert=E,tensor=T` on a device
mesh; `--coordinator/--num-processes/--process-id` join a multi-host run (jax.distributed), where
every process runs the same command and process 0 writes the outputs. `serve` runs multi-host the
same way: process 0 serves gRPC and schedules, the others run each step with it (serving.engine.multihost).

Errors a user can cause (bad paths, malformed configs or checkpoints, bad ids) print one line
naming the problem and exit with status 2; nothing is half-written (outputs are written to a
temporary file and renamed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from serving.cli_help import DefaultsHelp


def _read_ids(path: str, field: str) -> list[int]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{field}: file {path} does not exist") from None
    except OSError as e:  # a directory, no permission
        raise ValueError(f"{field}: cannot read {path} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{field}: {path} is not a text (JSON) file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise ValueError(f"{field}: {path} must hold a JSON list of integer token ids")
    return data


def _read_request(path: str) -> dict:
    """A fixture-style request (`inputs.json`): `prompt_text` (+ `image_files`), or `prompt_ids`
    (+ `token_types`, `image_files`), optionally `decode_ids`. Checked here, before the model loads;
    image files are resolved next to the JSON file."""
    field = "--request"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{field}: file {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{field}: {path} is not a text (JSON) file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {path} must hold a JSON object (a request like a fixture's inputs.json)")

    def int_list(key: str) -> list[int] | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ValueError(f"{field}: '{key}' in {path} must be a list of integers")
        return value

    text = data.get("prompt_text")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{field}: 'prompt_text' in {path} must be a string")
    ids, types, decode = int_list("prompt_ids"), int_list("token_types"), int_list("decode_ids")
    if text is None and not ids:
        raise ValueError(f"{field}: {path} has neither 'prompt_text' nor a non-empty 'prompt_ids'")
    if ids is not None and types is not None and len(types) != len(ids):
        raise ValueError(f"{field}: 'token_types' has {len(types)} entries but 'prompt_ids' has {len(ids)}")
    files = data.get("image_files") or []
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ValueError(f"{field}: 'image_files' in {path} must be a list of file names")
    images = [Path(path).parent / f for f in files]
    for i, image in enumerate(images):
        if not image.is_file():
            raise ValueError(f"{field}: image_files[{i}] {image} does not exist")
    if text is None and images and types is None:
        raise ValueError(f"{field}: 'prompt_ids' with 'image_files' need 'token_types' to place the images")
    return {"text": text, "ids": ids, "types": types, "images": images, "decode": decode}


def _encode_request(model, request: dict) -> tuple[list[int], object, object]:
    """(prompt ids, token_types, span_embeds) of a `_read_request` result. `prompt_text` is encoded as
    it stands, without an added BOS (a rendered prompt spells it, as the reference's
    `prepare_vl_inputs` reads it); when `prompt_ids` are also given they must agree with it."""
    import numpy as np

    from ced_jax.text_ids import encode_ids

    types = spans = None
    if request["text"] is not None:
        if request["images"]:
            ids, types, spans = model.encode_vl(request["text"], request["images"], add_bos=False)
        else:
            text_ids = encode_ids(model.tokenizer, request["text"], add_special_tokens=False)
            ids = np.asarray(text_ids, np.int32)
        if request["ids"] is not None and list(ids) != request["ids"]:
            raise ValueError("--request: 'prompt_ids' differ from the encoded 'prompt_text'")
        if request["types"] is not None and types is not None and list(types) != request["types"]:
            raise ValueError("--request: 'token_types' differ from those of 'prompt_text' and its images")
        return [int(i) for i in ids], types, spans
    ids = request["ids"]
    if request["images"]:
        types = np.asarray(request["types"], np.int32)
        spans = model.span_embeds_for(types, request["images"])
    elif request["types"] is not None and any(t >= 0 for t in request["types"]):
        raise ValueError("--request: 'token_types' mark image spans but no 'image_files' are given")
    return ids, types, spans


def _read_arrays(path: str | None, field: str) -> dict:
    if path is None:
        return {}
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not Path(path).exists():
        raise ValueError(f"{field}: file {path} does not exist")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{field}: {path} is not a readable safetensors file ({e})") from None


def _write_atomic_safetensors(arrays: dict, out: str) -> None:
    from safetensors.numpy import save_file

    out_path = Path(out)
    try:
        fd, tmp = tempfile.mkstemp(dir=out_path.parent, suffix=".tmp")
    except OSError as e:  # checked before computing (_check_output_file); this is a late change
        raise ValueError(f"cannot write {out} ({e.strerror})") from None
    os.close(fd)
    try:
        save_file(arrays, tmp)
        os.replace(tmp, out_path)
    except OSError as e:  # e.g. the disk filled up
        raise ValueError(f"cannot write {out} ({e.strerror})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_processes(args) -> None:
    """--coordinator / --num-processes / --process-id go together."""
    if args.coordinator is None:
        if args.num_processes is not None or args.process_id is not None:
            raise ValueError("--num-processes / --process-id need --coordinator HOST:PORT")
        return
    if args.num_processes is None or args.process_id is None:
        raise ValueError("--coordinator needs --num-processes and --process-id")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")


def _setup_distributed(args, *, recoverable: bool = False) -> None:
    """Join a multi-process JAX run (jax.distributed) before anything touches a device.
    recoverable: the distributed runtime reports a dead process instead of terminating the others
    (`serve`, which then turns NOT_SERVING: serving.engine.multihost)."""
    _check_processes(args)
    if args.coordinator is None:
        return
    import jax

    if recoverable:
        jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
    )


def _lockstep(args):
    """A context in which, in a multi-process run, every compile ends at a barrier of all processes
    (serving.engine.multihost), so one that loads a program from the persistent compilation cache does not
    start it while a peer still compiles (gloo gives up on a peer after 30 s)."""
    if args.coordinator is None:
        return contextlib.nullcontext()
    from serving.engine.multihost import Cluster, lockstep

    return lockstep(Cluster())


def _mesh(args):
    """The --mesh device mesh over every device of every process (None: one device)."""
    if args.mesh is None:
        if args.coordinator is not None and args.num_processes > 1:
            raise ValueError("a multi-process run needs --mesh (e.g. --mesh expert=4,tensor=2)")
        return None
    from ced_jax import sharding

    return sharding.make_mesh(sharding.parse_mesh(args.mesh))


def _is_writer() -> bool:
    """In a multi-process run every process holds the (replicated) outputs; process 0 writes them."""
    import jax

    return jax.process_index() == 0


def _load_sharded(args):
    from ced_jax.api import load

    return load(
        args.model,
        impl=args.impl,
        mesh=_mesh(args),
        rules=args.rules,
        engram_placement=args.engram_placement,
        weight_layout=args.weight_layout,
        compilation_cache=not args.no_compilation_cache,
        compilation_cache_dir=args.compilation_cache_dir,
    )


# ---------------------------------------------------------------------- option checks
# The numbers and output paths of a command are checked before any device is touched or a model is
# loaded, so a mistake costs a second, not a load and a compile, and reads as one line naming the flag.
SEED_LIMIT = 2**32  # jax.random.PRNGKey keeps 32 bits (2**32 gives the key of 0); the server's is uint32


def _check_at_least(flag: str, value: float | None, minimum: float) -> None:
    """A given number (None: not given) must be >= minimum; NaN never is, and a float must be finite."""
    if value is None:
        return
    if isinstance(value, float):
        if not (math.isfinite(value) and value >= minimum):
            raise ValueError(f"{flag} must be a finite number >= {minimum:g}, got {value}")
    elif value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def _check_output_file(flag: str, path: str | None) -> None:
    """`path` (None: not given) is a file that can be written: not a directory, in a directory that
    exists and takes new files (probed with a temporary file, as the output is written later)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {target.parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    except OSError as e:  # read-only filesystem, no permission
        raise ValueError(f"{flag} {path}: cannot create files in {target.parent} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def _check_mesh_and_hosts(args) -> None:
    """--mesh names known axes once each with sizes >= 1; the multi-host numbers are positive."""
    if args.mesh is not None:
        from ced_jax.sharding import parse_mesh  # parsing only; no device is touched

        parse_mesh(args.mesh)
    _check_at_least("--num-processes", args.num_processes, 1)
    _check_at_least("--process-id", args.process_id, 0)
    _check_at_least("--init-timeout", args.init_timeout, 1)


def _context_length(model: str) -> int | None:
    """The context (max_position_embeddings) of a preset or checkpoint directory; None when `model`
    is neither, which loading then reports."""
    cfg = _model_config(model)
    return None if cfg is None else cfg.max_position_embeddings


def _check_logits_options(args) -> None:
    if (args.prompt_ids is None) == (args.request is None):
        raise ValueError("give the prompt as exactly one of --prompt-ids and --request")
    _check_mesh_and_hosts(args)
    _check_at_least("--prefill-chunk", args.prefill_chunk, 1)
    _check_output_file("--out", args.out)
    _check_output_file("--capture", args.capture)
    if args.capture is not None and Path(args.capture).resolve() == Path(args.out).resolve():
        raise ValueError("--capture must be a different file than --out")


def _check_generate_options(args) -> None:
    _check_mesh_and_hosts(args)
    _check_at_least("--max-tokens", args.max_tokens, 1)
    _check_at_least("--temperature", args.temperature, 0.0)
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give the text to continue")
    if not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    context = _context_length(args.model)
    if context is not None and args.max_tokens > context:
        raise ValueError(f"--max-tokens {args.max_tokens} is beyond the model's context of {context} tokens")


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


def _model_config(model: str):
    """The ModelConfig of a preset or checkpoint directory; None when `model` is neither (loading
    then reports it)."""
    from ced_jax.config import PRESETS, ModelConfig, preset

    if model in PRESETS:
        return preset(model)
    if Path(model).is_dir() and (Path(model) / "config.json").is_file():
        return ModelConfig.from_pretrained(model)
    return None


def _auto_context(args) -> int:
    """--max-context auto (serving.planning.capacity.auto_max_context): from the model, the memory and
    --num-pages."""
    page = args.page_size
    _check_at_least("--max-slots", args.max_slots, 1)
    _check_at_least("--page-size", page, 1)
    cfg = _model_config(args.model)
    if cfg is None:
        return _serve_defaults().max_context
    if args.num_pages is not None:
        _check_at_least("--num-pages", args.num_pages, 1)
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
        _check_processes(args)
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
    """Each shape and limit by its flag (ServeConfig then checks how they combine). `auto` values are
    resolved here, first."""
    _check_mesh_and_hosts(args)
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
        ("--max-running", args.max_running, 1),
        ("--max-queued", args.max_queued, 0),
        ("--max-tokens-limit", args.max_tokens_limit, 1),
        ("--grace-period", args.grace_period_s, 0.0),
    )
    for flag, value, minimum in at_least:
        _check_at_least(flag, value, minimum)
    page = args.page_size
    if args.max_context % page:
        raise ValueError(f"--max-context {args.max_context} must be a multiple of --page-size {page}")
    if args.prefill_chunk % page:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk} must be a multiple of --page-size {page}")
    if args.num_pages is not None and args.num_pages * page < args.max_context:
        raise ValueError(
            f"--num-pages {args.num_pages} x --page-size {page} must hold one request of --max-context "
            f"{args.max_context} tokens (at least {-(-args.max_context // page)} pages)"
        )
    if args.max_running is not None and args.max_running > args.max_slots:
        raise ValueError(f"--max-running {args.max_running} must not exceed --max-slots {args.max_slots}")
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
    if args.prefill_token_budget is not None and args.prefill_token_budget < page:
        raise ValueError(
            f"--prefill-token-budget must be >= --page-size {page} (a page per step at least), "
            f"got {args.prefill_token_budget}"
        )
    step, long_chunk = args.long_prefill_step, args.long_prefill_chunk
    if step < 1 or step % page:
        raise ValueError(f"--long-prefill-step must be a positive multiple of --page-size {page}, got {step}")
    if long_chunk and (
        long_chunk % step or long_chunk <= args.prefill_chunk or long_chunk > args.max_context
    ):
        raise ValueError(
            f"--long-prefill-chunk must be 0 (off) or a multiple of --long-prefill-step {step} above "
            f"--prefill-chunk {args.prefill_chunk} and at most --max-context {args.max_context}, "
            f"got {long_chunk}"
        )


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


def cmd_describe(args) -> int:
    from ced_jax.api import describe
    from ced_jax.config import PRESETS, ModelConfig, preset

    cfg = preset(args.model) if args.model in PRESETS else ModelConfig.from_pretrained(args.model)
    print(json.dumps(describe(cfg), indent=2))
    return 0


def _read_patch_layers(text: str | None, have_patch: bool) -> list[int] | None:
    if text is None:
        return None
    if not have_patch:
        raise ValueError("--patch-layers: needs --patch")
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--patch-layers: expected comma-separated layer ids, got {text!r}") from None


def cmd_logits(args) -> int:
    import numpy as np

    _check_logits_options(args)
    _check_compilation_cache_options(args)
    _setup_distributed(args)
    request = None
    if args.request is not None:
        request = _read_request(args.request)
    else:
        prompt = _read_ids(args.prompt_ids, "--prompt-ids")
        if not prompt:
            raise ValueError(
                f"--prompt-ids: {args.prompt_ids} holds no token ids; the prompt needs at least one"
            )
    if args.decode_ids:
        decode = _read_ids(args.decode_ids, "--decode-ids")
    else:
        decode = (request or {}).get("decode") or []
    replay = _read_arrays(args.replay, "--replay")
    patch = _read_arrays(args.patch, "--patch")
    model = _load_sharded(args)
    types = spans = None
    if request is not None:
        prompt, types, spans = _encode_request(model, request)
    with _lockstep(args):
        result = model.logits(
            prompt,
            decode,
            index_k_mode=args.index_k_mode,
            replay=replay,
            patch=patch,
            capture=bool(args.capture),
            prefill_chunk=args.prefill_chunk,
            patch_layers=_read_patch_layers(args.patch_layers, bool(patch)),
            token_types=types,
            span_embeds=spans,
            prefill_mode=args.prefill_mode,
        )
    outputs = {"prefill_logits_full": result["prefill_logits_full"], "decode_logits": result["decode_logits"]}
    if patch:
        for key in ("prefill_block_output", "decode_block_output"):
            if key in result:
                outputs[key] = result[key]
    if not _is_writer():
        return 0
    _write_atomic_safetensors({k: np.ascontiguousarray(v) for k, v in outputs.items()}, args.out)
    if args.capture:
        captured = {
            k: np.ascontiguousarray(v.astype(np.int32))
            for k, v in result.items()
            if "topk" in k or "gate_indices" in k
        }
        _write_atomic_safetensors(captured, args.capture)
    images = 0 if types is None else int(np.sum(np.asarray(types) == 0))
    print(
        json.dumps(
            {"out": args.out, "prefill_tokens": len(prompt), "decode_tokens": len(decode), "images": images}
        )
    )
    return 0


def cmd_generate(args) -> int:
    _check_generate_options(args)
    _check_compilation_cache_options(args)
    _setup_distributed(args)
    images = [Path(p) for p in args.image or []]
    for i, image in enumerate(images):
        if not image.is_file():
            raise ValueError(f"--image {image} does not exist (image {i + 1})")
    model = _load_sharded(args)
    with _lockstep(args):
        result = model.generate(
            args.prompt,
            args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            images=images or None,
            dspark=args.dspark,
            prefill_mode=args.prefill_mode,
        )
    if not _is_writer():
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(result.get("text", result["token_ids"]))
    return 0


def _add_prefill_mode_option(p, default: str, *, per_request: bool = False) -> None:
    from ced_jax.options import PREFILL_MODES

    p.add_argument(
        "--prefill-mode",
        choices=PREFILL_MODES,
        default=default,
        help="exact: every layer over every prompt token (the reference's numbers); ced: the causal "
        "encoder-decoder prefill (spec 4.2), the encoder layers over the whole prompt and the decoder "
        "layers only over its last sliding window (about half the prefill work on long prompts, not "
        f"bit-identical). Default {default}"
        + (
            " (per request: GenerateRequest.prefill_mode, the HTTP body's prefill_mode)"
            if per_request
            else ""
        ),
    )


def _check_compilation_cache_options(args) -> None:
    """Before any model load (and, for serve, before the ports are bound)."""
    if args.compilation_cache_dir is None:
        return
    if args.no_compilation_cache:
        raise ValueError(
            "--compilation-cache-dir with --no-compilation-cache: the cache is turned off; give one"
        )
    try:
        Path(args.compilation_cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compilation-cache-dir {args.compilation_cache_dir}: {e.strerror or e}") from None


def _add_compilation_cache_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compilation cache")
    g.add_argument(
        "--compilation-cache-dir",
        metavar="DIR",
        default=None,
        help="JAX's persistent compilation cache: compiled programs are kept here and loaded by the next "
        "start with the same flags, JAX / XLA version and device kind (default: $JAX_COMPILATION_CACHE_DIR "
        "if set, else the per-user cache directory: ~/.cache/ced-jax/xla on Linux, ~/Library/Caches/ced-jax/"
        "xla on macOS)",
    )
    g.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program, read and write no cache (default: the cache is on)",
    )


def _add_mesh_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices and hosts")
    g.add_argument(
        "--mesh",
        help="run on a device mesh, e.g. data=1,expert=4,tensor=2 (missing axes are 1; the sizes "
        "must multiply to the number of devices of all processes)",
    )
    g.add_argument(
        "--rules",
        choices=("ep_tp", "tp", "replicated", "dp_ep"),
        default="ep_tp",
        help="sharding rules (ced_jax.sharding): expert + tensor parallel, pure tensor parallel, none, "
        "or data-parallel attention + expert parallel (each device serves its own sequences and pages; "
        "max_slots, num_pages, decode buckets and prefill rows must divide by the devices)",
    )
    g.add_argument(
        "--engram-placement",
        choices=("host", "device"),
        default=None,
        help="where the Engram tables live: host (memory-mapped or in RAM; each step's rows are gathered "
        "there and sent with its inputs, no device memory) or device (in the parameters); default: host",
    )
    g.add_argument(
        "--weight-layout",
        choices=("stored", "f32-dense", "f32"),
        default=None,
        help="how the FP8/FP4 weights are kept (ced_jax.checkpoint.weight_layout): as released, the FP8 "
        "linears "
        "dequantised to f32 once at load, or those and the routed experts; same values, dequantised "
        "once instead of at every step. Default: f32 on one CPU device when the experts' f32 copy "
        "stays under 1 GiB (and not with --impl pallas), else stored",
    )
    g.add_argument("--coordinator", help="multi-host: jax.distributed coordinator address HOST:PORT")
    g.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, help="multi-host: this process's index")
    g.add_argument(
        "--init-timeout", type=int, default=300, help="multi-host: seconds to wait for every process"
    )


def _http_models(args):
    """ModelNames with the --model-alias values (each NAME or NAME=thinking|non-thinking)."""
    from serving.model_names import ModelNames, parse_alias

    try:
        return ModelNames(extra_aliases=tuple(parse_alias(v) for v in args.model_alias or ()))
    except ValueError as e:
        raise ValueError(f"--model-alias: {e}") from None


def _http_limits(args):
    """AdmissionLimits from --http-max-concurrent / --max-effort-concurrent / --max-effort-queue."""
    from serving.admission import AdmissionLimits

    _check_at_least("--http-max-concurrent", args.http_max_concurrent, 1)
    if args.http_max_body_bytes is not None:
        _check_at_least("--http-max-body-bytes", args.http_max_body_bytes, 1)
    _check_at_least("--max-effort-concurrent", args.max_effort_concurrent, 1)
    _check_at_least("--max-effort-queue", args.max_effort_queue, 0)
    _check_at_least("--http-keepalive", args.http_keepalive_s, 0.0)
    return AdmissionLimits(
        max_concurrent=args.http_max_concurrent,
        max_tier_concurrent=args.max_effort_concurrent,
        max_tier_queue=args.max_effort_queue,
    )


def _image_options(args) -> dict:
    """ServeConfig's image fields from --feature-cache-bytes, --max-images-per-request, --max-image-bytes,
    --allow-image-urls / --image-url-* and --files-*, each checked by its flag."""
    from serving.files import FilesConfig
    from serving.image_fetch import ImageFetchConfig

    _check_at_least("--feature-cache-bytes", args.feature_cache_bytes, 0)
    _check_at_least("--max-images-per-request", args.max_images_per_request, 1)
    _check_at_least("--max-image-bytes", args.max_image_bytes, 1)
    _check_at_least("--image-url-max-bytes", args.image_url_max_bytes, 1)
    _check_at_least("--image-url-timeout", args.image_url_timeout, 0.001)
    _check_at_least("--files-max-file-bytes", args.files_max_file_bytes, 1)
    _check_at_least("--files-max-total-bytes", args.files_max_total_bytes, 1)
    _check_at_least("--files-max-per-identity", args.files_max_per_identity, 1)
    _check_at_least("--files-max-bytes-per-identity", args.files_max_bytes_per_identity, 1)
    _check_at_least("--files-ttl", args.files_ttl, 0.001)
    hosts = ()
    if args.allow_image_urls is not None:
        hosts = tuple(h.strip() for h in args.allow_image_urls.split(","))
        if not all(hosts):
            raise ValueError(f"--allow-image-urls: expected HOST[,HOST...], got {args.allow_image_urls!r}")
    try:
        fetch = ImageFetchConfig(
            allow_image_urls=bool(hosts),
            allowed_hosts=hosts,
            max_bytes=args.image_url_max_bytes,
            timeout_s=args.image_url_timeout,
        )
    except ValueError as e:
        raise ValueError(f"--allow-image-urls: {e}") from None
    if args.files_max_file_bytes > args.files_max_total_bytes:
        raise ValueError(
            f"--files-max-file-bytes {args.files_max_file_bytes} exceeds --files-max-total-bytes "
            f"{args.files_max_total_bytes}"
        )
    if args.files_max_file_bytes > args.files_max_bytes_per_identity:
        raise ValueError(
            f"--files-max-file-bytes {args.files_max_file_bytes} exceeds --files-max-bytes-per-identity "
            f"{args.files_max_bytes_per_identity}"
        )
    files = FilesConfig(
        max_file_bytes=args.files_max_file_bytes,
        max_total_bytes=args.files_max_total_bytes,
        max_files_per_identity=args.files_max_per_identity,
        max_bytes_per_identity=args.files_max_bytes_per_identity,
        ttl_s=args.files_ttl,
    )
    return dict(http_files=files, http_image_fetch=fetch)


def _check_port_option(option: str, port: int, off: int | None = None) -> None:
    if port != off and not 0 <= port <= 65535:
        also = "" if off is None else f", or {off} (off)"
        raise ValueError(f"{option} must be in 0..65535 (0: any free port){also}, got {port}")


def _serve_config(args):
    """The `ServeConfig` of the serve flags (shared by `serve` and `compile`), checked before anything
    slow: every number, key file, port and the KV disk directory."""
    _check_serve_options(args)
    _check_compilation_cache_options(args)
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
    _check_at_least("--max-prompt-bytes", args.max_prompt_bytes, 1)
    _check_at_least("--max-tokenize-bytes", args.max_tokenize_bytes, 1)
    for flag in ("--prepare-workers", "--image-fetch-workers", "--tokenize-workers"):
        _check_at_least(flag, getattr(args, flag[2:].replace("-", "_")), 1)
    chunk = args.prefill_chunk
    config = ServeConfig(
        **_config_values(args),
        max_context=args.max_context,
        prefill_buckets=(chunk,),
        prefill_rows=_prefill_rows(args),  # None: ServeConfig's default for these shapes
        decode_context_buckets=_context_buckets(args),  # likewise
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(_serve_defaults().default_max_tokens, args.max_tokens_limit),
        enable_prefix_cache=not args.no_prefix_cache,
        prefill_mode=args.prefill_mode,
        api_keys=api_keys,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        metrics_host=args.host,
        http_port=None if args.http_port <= 0 else args.http_port,
        http_models=_http_models(args),
        http_limits=_http_limits(args),
        **_image_options(args),
    )  # validates the shapes before anything is loaded
    # Before the model loads: a busy, unwritable or foreign directory fails at once.
    if config.kv_disk_dir is not None:
        from serving.scheduling.kv_tiers import DiskTier

        try:
            DiskTier.check_directory(config.kv_disk_dir)
        except RuntimeError as e:
            raise ValueError(f"--kv-disk-dir: {e}") from None
    return config


def cmd_serve(args) -> int:
    """`ced-jax serve MODEL`: bind the ports, load, compile the engine's programs, serve gRPC until
    SIGTERM. Options are checked and ports bound before anything slow (JAX is imported by the loader)."""
    from serving.server import serve

    config = _serve_config(args)
    chunk = args.prefill_chunk
    cluster = _serve_cluster(args)
    if cluster is not None and not cluster.is_leader:
        return _serve_follower(args, config, cluster)

    def load():  # called by serve once every port is bound
        from serving.engine.jax_engine import JaxEngine, ModelTokenizer

        model = _load_sharded(args)
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


def cmd_compile(args) -> int:
    """`ced-jax compile MODEL [serve flags]`: the server's start-up without serving. Every program the
    server would build for these flags goes into the persistent compilation cache; a table of them
    (fresh compiles, cache loads, seconds) and the cache's size are printed. Multi-host: every
    process runs it, as `serve` (process 0 drives the others' programs, as it does there)."""
    import time

    config = _serve_config(args)
    if args.no_compilation_cache:
        raise ValueError("--no-compilation-cache: compile writes the compilation cache; drop the flag")
    cluster = _serve_cluster(args)
    if cluster is not None and not cluster.is_leader:
        return _serve_follower(args, config, cluster)
    from ced_jax import compile_cache
    from serving.engine.jax_engine import JaxEngine

    started = time.perf_counter()
    try:
        model = _load_sharded(args)
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


def _serve_cluster(args):
    """The multi-host `Cluster` of a `serve` or `compile` run with --coordinator flags, else None."""
    if args.coordinator is None and args.num_processes is None and args.process_id is None:
        return None
    if args.mesh is None:
        raise ValueError("a multi-process run needs --mesh (e.g. --mesh expert=4,tensor=2)")
    _setup_distributed(args, recoverable=True)
    from serving.engine.multihost import Cluster

    return Cluster()


def _serve_follower(args, config, cluster) -> int:
    """A process other than 0 of a multi-host `serve`: the model and the engine's state on its devices,
    then the leader's calls until it stops (serving.engine.multihost)."""
    from serving.engine.jax_engine import JaxEngine
    from serving.engine.multihost import follow

    model = _load_sharded(args)
    engine = JaxEngine(model, config)  # the same Engine (state, programs, history) as the leader's
    print(f"ced-jax: process {cluster.process_id} of {cluster.num_processes} following process 0", flush=True)
    rc = follow(engine.engine, cluster)
    print(
        f"ced-jax: process {cluster.process_id}: stopped by process 0; {cluster.compile_barriers} compile "
        f"barriers, {cluster.barrier_seconds:.1f} s waiting there",
        flush=True,
    )
    return rc


def _check_plan_options(args) -> None:
    _check_at_least("--devices", args.devices, 1)
    if not (math.isfinite(args.device_memory) and args.device_memory > 0):
        raise ValueError(f"--device-memory must be a finite number of GiB > 0, got {args.device_memory}")
    _check_at_least("--host-memory", args.host_memory, 0.0)
    for flag, value in (
        ("--max-seqs", args.max_seqs),
        ("--context", args.context),
        ("--prefill-bucket", args.prefill_bucket),
        ("--page-size", args.page_size),
    ):
        _check_at_least(flag, value, 1)
    _check_at_least("--dspark", args.dspark, 0)
    _check_at_least("--compile-processes", args.compile_processes, 1)
    _check_at_least("--compile-timeout", args.compile_timeout, 1)
    if args.compile and args.devices % args.compile_processes:
        raise ValueError(
            f"--compile-processes {args.compile_processes} does not divide --devices {args.devices} "
            "(every process holds the same number of fake devices)"
        )
    if args.mesh is not None:
        from ced_jax.sharding import parse_mesh  # parsing only (its errors name --mesh)

        parse_mesh(args.mesh)


def cmd_plan(args) -> int:
    _check_plan_options(args)
    from ced_jax import sharding
    from ced_jax.config import PRESETS, ModelConfig, preset
    from serving.planning.capacity import Hardware, format_plan, plan

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
        Hardware(args.devices, args.device_memory, args.host_memory),
        mesh=None if args.mesh is None else sharding.parse_mesh(args.mesh),
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


def cmd_convert(args) -> int:
    from conversion.cli import run

    return run(args)


def _add_convert_options(p: argparse.ArgumentParser) -> None:
    """`ced-jax convert` and `convert_weights` (here, not in conversion.convert, so that building
    the parser stays free of JAX imports)."""
    p.add_argument("--hf-dir", required=True, help="released-layout checkpoint (index + safetensors shards)")
    p.add_argument(
        "--out",
        required=True,
        help="output directory; must not exist, or with --overwrite be a previous conversion (or empty)",
    )
    p.add_argument(
        "--include",
        default=None,
        help="comma-separated parts: text, dspark, vision (written as separate host-side items); "
        "default: text, plus vision when config.json has a vision tower and dspark when it has DSpark "
        "stages whose mtp.* tensors the index lists",
    )
    p.add_argument(
        "--engram",
        choices=("separate", "inline", "skip"),
        default="separate",
        help="Engram hash tables: a separate Orbax item for host memory (default), in params, or left out",
    )
    p.add_argument(
        "--weights-dtype",
        choices=("native", "bf16"),
        default="native",
        help="native: FP8/FP4 packed with their scales (what ced_jax runs); bf16: everything dequantised",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out that is a previous conversion (has ced_manifest.json) or empty",
    )
    p.add_argument("--no-compression", action="store_true", help="store chunks uncompressed (faster)")
    p.add_argument(
        "--no-engram-raw",
        action="store_true",
        help="do not also write the Engram tables as raw memory-mappable files (engram_raw/; they let "
        "a host-placement load skip reading the tables into RAM, at twice their disk space)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert, command="convert", prog=p.prog)  # prog: for the interruption line


class _ImplAction(argparse.Action):
    """`--impl reference|pallas` and `--interpret` combined into one impl string (`ced_jax.options.Impl`) in
    `args.impl` ("reference", "pallas", "pallas:interpret"), whatever their order."""

    def __call__(self, parser, namespace, values, option_string=None):
        interpret = option_string == "--interpret" or getattr(namespace, "_impl_interpret", False)
        kind = getattr(namespace, "_impl_kind", None) if option_string == "--interpret" else values
        if interpret and kind == "reference":
            parser.error("--interpret runs the Pallas kernels in the interpreter; it needs --impl pallas")
        namespace._impl_kind, namespace._impl_interpret = kind, interpret
        namespace.impl = (kind or "pallas") + (":interpret" if interpret else "")


def _add_impl_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        choices=("reference", "pallas"),
        default="reference",
        action=_ImplAction,
        help="reference: pure jnp (default); pallas: the pallas_kernels kernels (TPU or GPU)",
    )
    p.add_argument(
        "--interpret",
        nargs=0,
        action=_ImplAction,
        dest="impl",
        default=argparse.SUPPRESS,
        help="run the Pallas kernels in the HLO interpreter (CPU); implies --impl pallas",
    )


def cmd_train_draft(args) -> int:
    """Self-distil the DSpark draft stages of MODEL on its backbone's greedy continuations
    (`ced_jax.training.dspark_train.distill`) and write them as released `mtp.*` tensors to --out; prints the
    held-out acceptance before and after (JSON on stdout, progress on stderr)."""
    for flag, value, minimum in (
        ("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--prompts", args.prompts, 1),
        ("--heldout", args.heldout, 1), ("--prompt-len", args.prompt_len, 1),
        ("--continuation-tokens", args.continuation_tokens, 1),
    ):  # fmt: skip
        _check_at_least(flag, value, minimum)
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    _check_output_file("--out", args.out)
    import ced_jax
    from ced_jax.training import dspark_train

    model = ced_jax.load(args.model)
    cfg = model.cfg
    if cfg.num_nextn_predict_layers <= 0:
        raise ValueError(f"--model {args.model}: the config has no DSpark stages (num_nextn_predict_layers)")
    if args.continuation_tokens < cfg.dspark_block_size + 2:
        raise ValueError(
            f"--continuation-tokens must be >= dspark_block_size + 2 = {cfg.dspark_block_size + 2}, "
            f"got {args.continuation_tokens}"
        )
    init = dspark_train.random_dspark_tree(cfg, args.init_seed) if args.init == "random" else None
    trained, log = dspark_train.distill(
        model, init_tree=init, n_prompts=args.prompts, n_heldout=args.heldout, prompt_len=args.prompt_len,
        continuation_tokens=args.continuation_tokens, steps=args.steps, batch=args.batch,
        learning_rate=args.lr, seed=args.seed, kl_weight=args.kl_weight,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip
    out = Path(args.out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    try:
        dspark_train.save_dspark_safetensors(trained, cfg, tmp)
        umask = os.umask(0)  # mkstemp made it 0600; give it the mode a plain new file would get
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(json.dumps({"out": str(out), **log.summary()}, indent=2))
    return 0


def _add_train_draft_parser(sub) -> None:
    p = sub.add_parser(
        "train-draft",
        help="self-distil the DSpark draft stages on the backbone's greedy continuations (optax, CPU)",
    )
    p.add_argument("--model", required=True, help="preset (tiny) or checkpoint directory with DSpark stages")
    p.add_argument("--out", required=True, help="the trained mtp.* tensors (one .safetensors file)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak Adam learning rate (cosine decay)")
    p.add_argument("--seed", type=int, default=0, help="prompts (held-out: seed + 1) and minibatches")
    p.add_argument("--continuation-tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=96, help="training prompts (random ids)")
    p.add_argument("--heldout", type=int, default=16, help="held-out prompts for the acceptance")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--kl-weight", type=float, default=0.5, help="weight of KL(backbone || draft)")
    p.add_argument(
        "--init", choices=("random", "model"), default="random",
        help="start from random draft weights (--init-seed) or the model's own DSpark stages",
    )  # fmt: skip
    p.add_argument("--init-seed", type=int, default=1234, help="random draft weights (tiny's own seed)")
    p.set_defaults(func=cmd_train_draft)


def _add_config_flags(groups: dict) -> None:
    """One flag per `ServeConfig` field that declares one (`serving.config.Flag`): its name, help,
    section and metavar from the declaration, its type and default from the field; the value lands
    under the field's name (`_config_values`)."""
    from serving.config import serve_flags

    for field, flag in serve_flags():
        kind = field.type.replace(" | None", "")
        kw = {"dest": field.name, "default": field.default, "help": flag.help}
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if field.default else "store_true"
        else:
            kw["type"] = {"int": int, "float": float, "str": str}[kind]
        groups[flag.group].add_argument(flag.name, **kw)


def _config_values(args) -> dict:
    """The `ServeConfig` fields the serve flags set directly (`_add_config_flags`)."""
    from serving.config import serve_flags

    return {field.name: getattr(args, field.name) for field, _ in serve_flags()}


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    """The flags of `serve`, shared by `compile` (the same flags build the same programs)."""
    p.add_argument("model", help="preset name (tiny) or checkpoint directory")
    from serving.config import ADMISSION, FLAG_GROUPS, IMAGES, SCHEDULING, SERVER, SHAPES, TENANTS

    serve = _serve_defaults()  # every default below is ServeConfig's (serving/config.py)
    groups = {name: p.add_argument_group(name) for name in FLAG_GROUPS}
    _add_config_flags(groups)
    # The flags that set a field in a form of their own ("auto", a list, another unit) or several
    # fields together.
    g = groups[SHAPES]
    g.add_argument(
        "--max-context",
        type=_int_or_auto("--max-context"),
        default="auto",
        help="prompt + generated tokens per request; auto: the largest the KV pool holds for --max-slots "
        "sequences (an accelerator's memory to 90 %% after weights and activations, on CPU 256 MiB of KV, "
        "or --num-pages), at most the model's own context",
    )
    g.add_argument(
        "--prefill-chunk", type=int, default=max(serve.prefill_buckets), help="prompt tokens per prefill call"
    )
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
    _add_prefill_mode_option(g, serve.prefill_mode, per_request=True)
    g = groups[ADMISSION]
    g.add_argument(
        "--max-tokens-limit",
        type=_int_or_auto("--max-tokens-limit"),
        default="auto",
        help="largest accepted max_tokens; auto: --max-context",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="do not reuse cached prompt pages")
    g = groups[TENANTS]
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
    # The command listens on the well-known ports; ServeConfig's own default (0, any free port) suits
    # servers started in-process (tests, benchmarks), which must not collide.
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
    limits = serve.http_limits
    g.add_argument(
        "--http-max-concurrent",
        type=int,
        default=limits.max_concurrent,
        help="HTTP requests in flight; beyond: 429 with Retry-After (the hosted API's limit by default)",
    )
    g.add_argument(
        "--max-effort-concurrent",
        type=int,
        default=limits.max_tier_concurrent,
        help="HTTP requests at reasoning effort max running at once (their own tier)",
    )
    g.add_argument(
        "--max-effort-queue",
        type=int,
        default=limits.max_tier_queue,
        help="effort-max requests waiting for their tier; beyond: 429",
    )
    g.add_argument(
        "--model-alias",
        action="append",
        help="accept another model name on the HTTP API: NAME, or NAME=thinking / NAME=non-thinking to "
        "force the mode (repeatable; deepseek-v4-flash, deepseek-chat, deepseek-reasoner, ... by default)",
    )
    g = groups[IMAGES]
    fetch, files = serve.http_image_fetch, serve.http_files
    g.add_argument(
        "--allow-image-urls",
        metavar="HOST[,HOST...]",
        help="HTTP API: fetch image URLs from these hosts (host or host:port); default: URLs are refused",
    )
    g.add_argument("--image-url-max-bytes", type=int, default=fetch.max_bytes, help="one fetched image")
    g.add_argument("--image-url-timeout", type=float, default=fetch.timeout_s, help="seconds per fetch")
    g.add_argument(
        "--files-max-file-bytes", type=int, default=files.max_file_bytes, help="Files API: one upload"
    )
    g.add_argument(
        "--files-max-total-bytes",
        type=int,
        default=files.max_total_bytes,
        help="Files API: bytes of files held for all identities together (in memory)",
    )
    g.add_argument(
        "--files-max-bytes-per-identity",
        type=int,
        default=files.max_bytes_per_identity,
        help="Files API: bytes of files one identity (API key) may hold",
    )
    g.add_argument(
        "--files-max-per-identity", type=int, default=files.max_files_per_identity, help="Files API: files"
    )
    g.add_argument(
        "--files-ttl", type=float, default=files.ttl_s, help="Files API: seconds a file lives after upload"
    )
    _add_impl_options(p)
    _add_mesh_options(p)
    _add_compilation_cache_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ced-jax", description="DeepSeek-V4.1-Flash in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("describe", help="config summary, parameter counts, KV bytes per token (JSON)")
    p.add_argument("model", help="preset name (tiny, v41-flash) or checkpoint directory")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("logits", help="teacher-forced logits, with capture / replay / patching")
    p.add_argument("model")
    p.add_argument("--prompt-ids", help="JSON list of token ids, prefilled from position 0")
    p.add_argument(
        "--request",
        help="the prompt as a JSON request like a vision fixture's inputs.json: prompt_text (encoded as "
        "is, no BOS added) with image_files (next to the JSON), or prompt_ids with token_types and "
        "image_files; its decode_ids unless --decode-ids",
    )
    p.add_argument("--decode-ids", help="JSON list of token ids fed one decode step at a time")
    p.add_argument("--index-k-mode", choices=("intended", "reference"), default="intended")
    p.add_argument(
        "--capture", help="write the decisions taken (top-k rows, expert ids) to this safetensors file"
    )
    p.add_argument("--replay", help="force the decisions in this safetensors file (fixture names)")
    p.add_argument("--patch", help="override block inputs from this safetensors file (fixture names)")
    p.add_argument(
        "--patch-layers",
        help="comma-separated layer ids whose block inputs --patch overrides (default: every layer)",
    )
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill in chunks of this many tokens")
    _add_prefill_mode_option(p, "exact")
    _add_impl_options(p)
    p.add_argument("--out", required=True)
    _add_mesh_options(p)
    _add_compilation_cache_options(p)
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("generate", help="text in, text out")
    p.add_argument("model")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--image",
        action="append",
        help="an image file for the next <｜deepseek_image｜> placeholder of --prompt (repeat in order)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dspark",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding with up to K DSpark drafts per step (0 = off; the checkpoint needs its "
        "mtp.* stages); --json then reports steps / proposed / accepted drafts",
    )
    _add_prefill_mode_option(p, "exact")
    _add_impl_options(p)
    p.add_argument("--json", action="store_true", help="print ids and text as JSON")
    _add_mesh_options(p)
    _add_compilation_cache_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "serve",
        help="gRPC server (ced.v1.InferenceService, health, reflection, Prometheus metrics)",
        description="Continuous batching over a static-shape paged KV cache; every program is compiled "
        "at start-up. SIGTERM stops admitting, lets streams finish for --grace-period, then exits 0.",
    )
    _add_serve_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "compile",
        help="compile every program `serve` would for these flags into the compilation cache, then exit",
        description="Builds the programs a `ced-jax serve` with the same flags builds at start-up (every "
        "prefill and decode bucket, table width, DSpark width and image variant) into the persistent "
        "compilation cache, prints each with its time and the cache's size, and exits without serving. "
        "A server started afterwards with the same flags and cache compiles nothing. On a multi-host "
        "mesh run it on every process, as serve.",
    )
    _add_serve_options(p)
    p.set_defaults(func=cmd_compile)

    # Listed for --help only: main() hands `client ...` to serving.client.main before parsing.
    sub.add_parser("client", help="stream a completion from a ced-jax server (ced-jax client --help)")

    p = sub.add_parser("convert", help="released HF checkpoint -> Orbax checkpoint (as convert_weights)")
    _add_convert_options(p)

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
    p.set_defaults(func=cmd_plan)

    _add_train_draft_parser(sub)
    for sub_parser in sub.choices.values():
        sub_parser.formatter_class = DefaultsHelp
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["client"]:  # the client has its own parser and needs no JAX
        from serving.client import main as client_main

        return client_main(argv[1:])
    args = build_parser().parse_args(argv)
    return _run(args, f"ced-jax {args.command}")


def _run(args, prog: str) -> int:
    try:
        return args.func(args)
    # ValueError covers the project's own input errors (ConfigError, CheckpointError, EngramConfigError,
    # ...); OSError a file the user named that cannot be read or written.
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2


def _one_line(message: str) -> str:
    """`message` with control characters escaped (a name the user typed may hold a newline), so that
    an error is always one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def convert_main(argv: list[str] | None = None) -> int:
    """The `convert_weights` console script: the same as `ced-jax convert`."""
    parser = argparse.ArgumentParser(
        prog="convert_weights",
        description="released HF checkpoint -> Orbax checkpoint (streaming)",
        formatter_class=DefaultsHelp,
    )
    _add_convert_options(parser)
    return _run(parser.parse_args(argv), prog="convert_weights")


if __name__ == "__main__":
    sys.exit(main())
