"""`ced-jax describe`: a model's config summary, parameter counts and KV bytes per token (JSON)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("describe", help="config summary, parameter counts, KV bytes per token (JSON)")
    p.add_argument("model", help="preset name (tiny, v41-flash) or checkpoint directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from ced_jax.api import describe
    from ced_jax.config import PRESETS, ModelConfig, preset

    cfg = preset(args.model) if args.model in PRESETS else ModelConfig.from_pretrained(args.model)
    print(json.dumps(describe(cfg), indent=2))
    return 0
