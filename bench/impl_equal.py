"""Whether two impls give the same logits, bit for bit, on one model: a random prompt, then greedy
decode steps, the same session shape for both (issue 38: impl="cpu" against the XLA path).

    python bench/impl_equal.py /tmp/mid-ckpt [--impls reference cpu] [--rows 2] [--prompt 40] [--steps 6]

Prints one JSON line per step (shape, equal or not, the share of logits that differ, the largest
difference) and a summary line with the greedy tokens of each impl."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ced_jax.api import load  # noqa: E402


def run(model_name: str, impl: str, rows: int, prompt_len: int, steps: int, layout: str, seed: int):
    model = load(model_name, impl=impl, weight_layout=layout)
    session = model.new_session(rows, prompt_len + steps + 8)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, min(200, model.cfg.vocab_size), (rows, prompt_len)).astype(np.int32)
    logits, _ = session.step(prompts)
    out, tokens = [np.asarray(logits)], []
    for _ in range(steps):
        last = out[-1][:, -1] if out[-1].ndim == 3 else out[-1]
        tok = last.argmax(-1).astype(np.int32)
        tokens.append(tok.tolist())
        logits, _ = session.step(tok[:, None])
        out.append(np.asarray(logits))
    return out, np.asarray(tokens).T.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--impls", nargs=2, default=["reference", "cpu"])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--weight-layout", default="stored")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    a, b = (
        run(args.model, i, args.rows, args.prompt, args.steps, args.weight_layout, args.seed)
        for i in args.impls
    )
    for step, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
        print(
            json.dumps(
                {
                    "step": step,
                    "shape": list(x.shape),
                    "equal": bool(np.array_equal(x, y)),
                    "differ": float(np.mean(x != y)),
                    "max_abs_diff": float(np.max(np.abs(x - y))),
                }
            )
        )
    print(
        json.dumps(
            {
                "impls": args.impls,
                "all_equal": all(np.array_equal(x, y) for x, y in zip(a[0], b[0], strict=True)),
                "tokens": {args.impls[0]: a[1], args.impls[1]: b[1]},
            }
        )
    )


if __name__ == "__main__":
    main()
