"""Parity with DeepSeek's reference on a golden fixture, in PARITY.md's mode A, as README quotes it.

    python bench/parity.py [FIXTURE]      # default tests/golden/tiny-a

Mode A: the fixture's recorded decisions replayed and every block input patched (`Model.logits` with
the fixture as `replay` and `patch`), per index-key mode. Prints, per mode, the prefill logits' mean
and max absolute error against the reference's, their mean KL(ref || ours), and the decode logits'
largest absolute error, as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ced_jax  # noqa: E402


def _kl(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(ours)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fixture", nargs="?", default=str(REPO / "tests" / "golden" / "tiny-a"))
    a = p.parse_args()
    golden = load_file(str(Path(a.fixture) / "expected.safetensors"))
    model = ced_jax.load(a.fixture)
    out = {"fixture": a.fixture}
    for mode in ("intended", "reference"):
        res = model.logits(
            golden["prompt_ids"], golden["decode_ids"], index_k_mode=mode, replay=golden, patch=golden
        )
        ours, ref = res["prefill_logits_full"], golden["prefill_logits_full"]
        err = np.abs(ours - ref)
        out[mode] = {
            "prefill_logits_mean_abs_error": float(err.mean()),
            "prefill_logits_max_abs_error": float(err.max()),
            "prefill_mean_kl": float(_kl(ref, ours).mean()),
            "decode_logits_max_abs_error": float(
                np.abs(res["decode_logits"] - golden[f"decode_logits_{mode}"]).max()
            ),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
