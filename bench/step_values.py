"""The values one prefill, one decode step and one logits step produce, to compare two trees bit for bit.

    python bench/step_values.py save OUT.npz          # in each tree (persistent cache off is safest)
    python bench/step_values.py compare A.npz B.npz   # every array byte-identical, or what differs

`tiny` preset, an `Engine` of 4 slots x 64 tokens: a 16-token prefill of 4 rows (16, 9, 0 and 3
valid tokens), one decode step, one `step` that returns logits; saved: the sampled tokens and
log-probabilities, the logits and every buffer of the engine state (packed pages and rings included).
Only the host API that both sides of a refactor share is used.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def save(out: str) -> None:
    import jax

    import ced_jax
    from ced_jax.engine import Engine, SamplingBatch, StateShapes

    model = ced_jax.load("tiny")
    engine = Engine(model.loaded, StateShapes(max_slots=4, page_size=16, num_pages=16, max_context=64))
    slots, tables = np.arange(4, dtype=np.int32), np.arange(16, dtype=np.int32).reshape(4, 4)
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (4, 16)).astype(np.int32)
    n = np.array([16, 9, 0, 3], np.int32)
    greedy = SamplingBatch.broadcast(4)
    start = np.zeros(4, np.int32)
    prefill = jax.device_get(engine.prefill_batch(slots, tokens, n, start, tables, greedy, max_logprobs=2))
    last = tokens[np.arange(4), np.maximum(n - 1, 0)]
    decode = jax.device_get(engine.dispatch_decode(slots, last, n, n > 0, tables, greedy, max_logprobs=2))
    logits, _ = engine.step(tokens[:, :1], n + 1, (n > 0).astype(np.int32), slots, tables)
    state = {f"state{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(engine.state))}
    np.savez(out, prefill=prefill[0], prefill_lp=prefill[1], decode=decode[0], decode_lp=decode[1],
             logits=np.asarray(logits), **state)  # fmt: skip


def compare(a_path: str, b_path: str) -> int:
    a, b = np.load(a_path), np.load(b_path)
    bad = sorted(set(a.files) ^ set(b.files))
    for k in sorted(set(a.files) & set(b.files)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            bad.append(f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
    print(f"{len(a.files)} arrays; " + ("all byte-identical" if not bad else f"differ: {bad}"))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save").add_argument("out")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "save":
        save(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
