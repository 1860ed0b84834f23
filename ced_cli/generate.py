"""`ced-jax generate`: text in, text out (images optional, DSpark speculative decoding optional)."""

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
    is_writer,
    load_model,
    lockstep_compiles,
    model_config,
    setup_distributed,
)

SEED_LIMIT = 2**32  # jax.random.PRNGKey keeps 32 bits (2**32 gives the key of 0); the server's is uint32


def add_parser(sub) -> None:
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
    add_prefill_mode_option(p, "exact")
    add_impl_options(p)
    p.add_argument("--json", action="store_true", help="print ids and text as JSON")
    add_mesh_options(p)
    add_compilation_cache_options(p)
    p.set_defaults(func=run)


def _context_length(model: str) -> int | None:
    """The context (max_position_embeddings) of a preset or checkpoint directory; None when `model`
    is neither, which loading then reports."""
    cfg = model_config(model)
    return None if cfg is None else cfg.max_position_embeddings


def _check_generate_options(args) -> None:
    check_mesh_and_hosts(args)
    check_at_least("--max-tokens", args.max_tokens, 1)
    check_at_least("--temperature", args.temperature, 0.0)
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give the text to continue")
    if not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    context = _context_length(args.model)
    if context is not None and args.max_tokens > context:
        raise ValueError(f"--max-tokens {args.max_tokens} is beyond the model's context of {context} tokens")


def run(args) -> int:
    _check_generate_options(args)
    check_compilation_cache_options(args)
    setup_distributed(args)
    images = [Path(p) for p in args.image or []]
    for i, image in enumerate(images):
        if not image.is_file():
            raise ValueError(f"--image {image} does not exist (image {i + 1})")
    model = load_model(args)
    with lockstep_compiles(args):
        result = model.generate(
            args.prompt,
            args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            images=images or None,
            dspark=args.dspark,
            prefill_mode=args.prefill_mode,
        )
    if not is_writer():
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(result.get("text", result["token_ids"]))
    return 0
