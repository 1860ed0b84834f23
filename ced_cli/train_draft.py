"""`ced-jax train-draft`: self-distil a model's DSpark draft stages on its backbone's greedy
continuations and write them as released `mtp.*` tensors."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from ced_cli.options import check_at_least, check_output_file


def add_parser(sub) -> None:
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
    p.set_defaults(func=run)


def run(args) -> int:
    """Self-distil the DSpark draft stages of MODEL on its backbone's greedy continuations
    (`ced_jax.training.dspark_train.distill`) and write them as released `mtp.*` tensors to --out; prints the
    held-out acceptance before and after (JSON on stdout, progress on stderr)."""
    for flag, value, minimum in (
        ("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--prompts", args.prompts, 1),
        ("--heldout", args.heldout, 1), ("--prompt-len", args.prompt_len, 1),
        ("--continuation-tokens", args.continuation_tokens, 1),
    ):  # fmt: skip
        check_at_least(flag, value, minimum)
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    check_output_file("--out", args.out)
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
