"""`ced-jax` command line: describe, logits, generate (and the converter entry point).

Errors a user can cause (bad paths, malformed configs or checkpoints, bad ids) print one line
naming the problem and exit with status 2; nothing is half-written (outputs are written to a
temporary file and renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def _read_ids(path: str, field: str) -> list[int]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{field}: file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise ValueError(f"{field}: {path} must hold a JSON list of integer token ids")
    return data


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
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(arrays, tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cmd_describe(args) -> int:
    from ced_jax.api import describe
    from ced_jax.config import PRESETS, ModelConfig, preset

    cfg = preset(args.model) if args.model in PRESETS else ModelConfig.from_pretrained(args.model)
    print(json.dumps(describe(cfg), indent=2))
    return 0


def cmd_logits(args) -> int:
    import numpy as np

    from ced_jax.api import load

    prompt = _read_ids(args.prompt_ids, "--prompt-ids")
    decode = _read_ids(args.decode_ids, "--decode-ids") if args.decode_ids else []
    replay = _read_arrays(args.replay, "--replay")
    patch = _read_arrays(args.patch, "--patch")
    model = load(args.model, impl=args.impl)
    result = model.logits(
        prompt,
        decode,
        index_k_mode=args.index_k_mode,
        replay=replay,
        patch=patch,
        capture=bool(args.capture),
        prefill_chunk=args.prefill_chunk,
    )
    outputs = {"prefill_logits_full": result["prefill_logits_full"], "decode_logits": result["decode_logits"]}
    if patch:
        for key in ("prefill_block_output", "decode_block_output"):
            if key in result:
                outputs[key] = result[key]
    _write_atomic_safetensors({k: np.ascontiguousarray(v) for k, v in outputs.items()}, args.out)
    if args.capture:
        captured = {
            k: np.ascontiguousarray(v.astype(np.int32))
            for k, v in result.items()
            if "topk" in k or "gate_indices" in k
        }
        _write_atomic_safetensors(captured, args.capture)
    print(json.dumps({"out": args.out, "prefill_tokens": len(prompt), "decode_tokens": len(decode)}))
    return 0


def cmd_generate(args) -> int:
    from ced_jax.api import load

    model = load(args.model, impl=args.impl)
    result = model.generate(args.prompt, args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print(result.get("text", result["token_ids"]))
    return 0


def cmd_convert(args) -> int:
    from conversion.convert import run

    return run(args)


def _add_convert_options(p: argparse.ArgumentParser) -> None:
    """`ced-jax convert` and `convert_weights` (here, not in conversion.convert, so that building
    the parser stays free of JAX imports)."""
    p.add_argument("--hf-dir", required=True, help="released-layout checkpoint (index + safetensors shards)")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument(
        "--include",
        default="text",
        help="comma-separated parts: text (default); dspark and vision are not implemented by the model",
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
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-compression", action="store_true", help="store chunks uncompressed (faster)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert, command="convert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ced-jax", description="DeepSeek-V4.1-Flash in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("describe", help="config summary, parameter counts, KV bytes per token (JSON)")
    p.add_argument("model", help="preset name (tiny, v41-flash) or checkpoint directory")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("logits", help="teacher-forced logits, with capture / replay / patching")
    p.add_argument("model")
    p.add_argument("--prompt-ids", required=True, help="JSON list of token ids, prefilled from position 0")
    p.add_argument("--decode-ids", help="JSON list of token ids fed one decode step at a time")
    p.add_argument("--index-k-mode", choices=("intended", "reference"), default="intended")
    p.add_argument(
        "--capture", help="write the decisions taken (top-k rows, expert ids) to this safetensors file"
    )
    p.add_argument("--replay", help="force the decisions in this safetensors file (fixture names)")
    p.add_argument("--patch", help="override block inputs from this safetensors file (fixture names)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill in chunks of this many tokens")
    p.add_argument("--impl", choices=("reference",), default="reference")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("generate", help="text in, text out")
    p.add_argument("model")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("reference",), default="reference")
    p.add_argument("--json", action="store_true", help="print ids and text as JSON")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("convert", help="released HF checkpoint -> Orbax checkpoint (as convert_weights)")
    _add_convert_options(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _run(args, f"ced-jax {args.command}")


def _run(args, prog: str) -> int:
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def convert_main(argv: list[str] | None = None) -> int:
    """The `convert_weights` console script: the same as `ced-jax convert`."""
    parser = argparse.ArgumentParser(
        prog="convert_weights", description="released HF checkpoint -> Orbax checkpoint (streaming)"
    )
    _add_convert_options(parser)
    return _run(parser.parse_args(argv), prog="convert_weights")


if __name__ == "__main__":
    sys.exit(main())
