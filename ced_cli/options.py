"""What several `ced-jax` commands share: the option groups (devices and hosts, --impl, the compilation
cache, --prefill-mode), the readers of request / ids / arrays files, the checks of numbers and output
paths, multi-host setup and the model load."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from pathlib import Path


def read_ids(path: str, field: str) -> list[int]:
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


def read_request(path: str) -> dict:
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


def encode_request(model, request: dict) -> tuple[list[int], object, object]:
    """(prompt ids, token_types, span_embeds) of a `read_request` result. `prompt_text` is encoded as
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


def read_arrays(path: str | None, field: str) -> dict:
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


def write_atomic_safetensors(arrays: dict, out: str) -> None:
    from safetensors.numpy import save_file

    out_path = Path(out)
    try:
        fd, tmp = tempfile.mkstemp(dir=out_path.parent, suffix=".tmp")
    except OSError as e:  # checked before computing (check_output_file); this is a late change
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


def check_processes(args) -> None:
    """--coordinator / --num-processes / --process-id go together."""
    if args.coordinator is None:
        if args.num_processes is not None or args.process_id is not None:
            raise ValueError("--num-processes / --process-id need --coordinator HOST:PORT")
        return
    if args.num_processes is None or args.process_id is None:
        raise ValueError("--coordinator needs --num-processes and --process-id")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")


def setup_distributed(args, *, recoverable: bool = False) -> None:
    """Join a multi-process JAX run (jax.distributed) before anything touches a device.
    recoverable: the distributed runtime reports a dead process instead of terminating the others
    (`serve`, which then turns NOT_SERVING: serving.engine.multihost)."""
    check_processes(args)
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


def lockstep_compiles(args):
    """A context in which, in a multi-process run, every compile ends at a barrier of all processes
    (serving.engine.multihost), so one that loads a program from the persistent compilation cache does not
    start it while a peer still compiles (gloo gives up on a peer after 30 s)."""
    if args.coordinator is None:
        return contextlib.nullcontext()
    from serving.engine.multihost import Cluster, lockstep

    return lockstep(Cluster())


def device_mesh(args):
    """The --mesh device mesh over every device of every process (None: one device)."""
    if args.mesh is None:
        if args.coordinator is not None and args.num_processes > 1:
            raise ValueError("a multi-process run needs --mesh (e.g. --mesh expert=4,tensor=2)")
        return None
    from ced_jax import sharding

    return sharding.make_mesh(sharding.parse_mesh(args.mesh))


def is_writer() -> bool:
    """In a multi-process run every process holds the (replicated) outputs; process 0 writes them."""
    import jax

    return jax.process_index() == 0


def load_model(args):
    from ced_jax.api import load

    return load(
        args.model,
        impl=args.impl,
        mesh=device_mesh(args),
        rules=args.rules,
        engram_placement=args.engram_placement,
        weight_layout=args.weight_layout,
        compilation_cache=not args.no_compilation_cache,
        compilation_cache_dir=args.compilation_cache_dir,
    )


# The numbers and output paths of a command are checked before any device is touched or a model is
# loaded, so a mistake costs a second, not a load and a compile, and reads as one line naming the flag.
def check_at_least(flag: str, value: float | None, minimum: float) -> None:
    """A given number (None: not given) must be >= minimum; NaN never is, and a float must be finite."""
    if value is None:
        return
    if isinstance(value, float):
        if not (math.isfinite(value) and value >= minimum):
            raise ValueError(f"{flag} must be a finite number >= {minimum:g}, got {value}")
    elif value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def check_output_file(flag: str, path: str | None) -> None:
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


def check_mesh_and_hosts(args) -> None:
    """--mesh names known axes once each with sizes >= 1; the multi-host numbers are positive."""
    if args.mesh is not None:
        from ced_jax.sharding import parse_mesh  # parsing only; no device is touched

        parse_mesh(args.mesh)
    check_at_least("--num-processes", args.num_processes, 1)
    check_at_least("--process-id", args.process_id, 0)
    check_at_least("--init-timeout", args.init_timeout, 1)


def model_config(model: str):
    """The ModelConfig of a preset or checkpoint directory; None when `model` is neither (loading
    then reports it)."""
    from ced_jax.config import PRESETS, ModelConfig, preset

    if model in PRESETS:
        return preset(model)
    if Path(model).is_dir() and (Path(model) / "config.json").is_file():
        return ModelConfig.from_pretrained(model)
    return None


def add_prefill_mode_option(p, default: str) -> None:
    """--prefill-mode of `logits` and `generate`, in the words of `serve`'s (ServeConfig.prefill_mode)."""
    from ced_jax.options import PREFILL_MODES
    from serving.flags import PREFILL_MODE_HELP

    p.add_argument("--prefill-mode", choices=PREFILL_MODES, default=default, help=PREFILL_MODE_HELP)


def check_compilation_cache_options(args) -> None:
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


def add_compilation_cache_options(p: argparse.ArgumentParser) -> None:
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


def add_mesh_options(p: argparse.ArgumentParser) -> None:
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
        "stays under 1 GiB (and not with --impl pallas or cpu), else stored",
    )
    g.add_argument("--coordinator", help="multi-host: jax.distributed coordinator address HOST:PORT")
    g.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, help="multi-host: this process's index")
    g.add_argument(
        "--init-timeout", type=int, default=300, help="multi-host: seconds to wait for every process"
    )


class _ImplAction(argparse.Action):
    """`--impl reference|pallas` and `--interpret` combined into one impl string (`ced_jax.options.Impl`) in
    `args.impl` ("reference", "pallas", "pallas:interpret"), whatever their order."""

    def __call__(self, parser, namespace, values, option_string=None):
        interpret = option_string == "--interpret" or getattr(namespace, "_impl_interpret", False)
        kind = getattr(namespace, "_impl_kind", None) if option_string == "--interpret" else values
        if interpret and kind in ("reference", "cpu"):
            parser.error("--interpret runs the Pallas kernels in the interpreter; it needs --impl pallas")
        namespace._impl_kind, namespace._impl_interpret = kind, interpret
        namespace.impl = (kind or "pallas") + (":interpret" if interpret else "")


def add_impl_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        choices=("reference", "pallas", "cpu"),
        default="reference",
        action=_ImplAction,
        help="reference: pure jnp (default); pallas: the pallas_kernels kernels (TPU or GPU); cpu: the CPU "
        "kernels built with ced-jax (the FP4 experts so far)",
    )
    p.add_argument(
        "--interpret",
        nargs=0,
        action=_ImplAction,
        dest="impl",
        default=argparse.SUPPRESS,
        help="run the Pallas kernels in the HLO interpreter (CPU); implies --impl pallas",
    )
