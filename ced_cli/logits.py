"""`ced-jax logits`: teacher-forced logits of a prompt (and decode ids), with capture / replay /
patching of the decisions and block inputs, written to safetensors."""

from __future__ import annotations

import json
from pathlib import Path

from ced_cli.options import (
    add_compilation_cache_options,
    add_impl_options,
    add_mesh_options,
    add_prefill_mode_option,
    check_at_least,
    check_compilation_cache_options,
    check_mesh_and_hosts,
    check_output_file,
    encode_request,
    is_writer,
    load_model,
    lockstep_compiles,
    read_arrays,
    read_ids,
    read_request,
    setup_distributed,
    write_atomic_safetensors,
)


def add_parser(sub) -> None:
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
    add_prefill_mode_option(p, "exact")
    add_impl_options(p)
    p.add_argument("--out", required=True)
    add_mesh_options(p)
    add_compilation_cache_options(p)
    p.set_defaults(func=run)


def _read_patch_layers(text: str | None, have_patch: bool) -> list[int] | None:
    if text is None:
        return None
    if not have_patch:
        raise ValueError("--patch-layers: needs --patch")
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--patch-layers: expected comma-separated layer ids, got {text!r}") from None


def _check_logits_options(args) -> None:
    if (args.prompt_ids is None) == (args.request is None):
        raise ValueError("give the prompt as exactly one of --prompt-ids and --request")
    check_mesh_and_hosts(args)
    check_at_least("--prefill-chunk", args.prefill_chunk, 1)
    check_output_file("--out", args.out)
    check_output_file("--capture", args.capture)
    if args.capture is not None and Path(args.capture).resolve() == Path(args.out).resolve():
        raise ValueError("--capture must be a different file than --out")


def run(args) -> int:
    import numpy as np

    _check_logits_options(args)
    check_compilation_cache_options(args)
    setup_distributed(args)
    request = None
    if args.request is not None:
        request = read_request(args.request)
    else:
        prompt = read_ids(args.prompt_ids, "--prompt-ids")
        if not prompt:
            raise ValueError(
                f"--prompt-ids: {args.prompt_ids} holds no token ids; the prompt needs at least one"
            )
    if args.decode_ids:
        decode = read_ids(args.decode_ids, "--decode-ids")
    else:
        decode = (request or {}).get("decode") or []
    replay = read_arrays(args.replay, "--replay")
    patch = read_arrays(args.patch, "--patch")
    model = load_model(args)
    types = spans = None
    if request is not None:
        prompt, types, spans = encode_request(model, request)
    with lockstep_compiles(args):
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
    if not is_writer():
        return 0
    write_atomic_safetensors({k: np.ascontiguousarray(v) for k, v in outputs.items()}, args.out)
    if args.capture:
        captured = {
            k: np.ascontiguousarray(v.astype(np.int32))
            for k, v in result.items()
            if "topk" in k or "gate_indices" in k
        }
        write_atomic_safetensors(captured, args.capture)
    images = 0 if types is None else int(np.sum(np.asarray(types) == 0))
    print(
        json.dumps(
            {"out": args.out, "prefill_tokens": len(prompt), "decode_tokens": len(decode), "images": images}
        )
    )
    return 0
