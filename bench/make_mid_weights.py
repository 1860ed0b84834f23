"""Generate the `mid` benchmark checkpoint (bench/configs/mid/README.md) and check its hashes.

    python bench/make_mid_weights.py --out DIR [--seed 3000] [--no-verify]

Writes the three shards, the index, config.json (copied byte for byte) and the tokenizer files
into DIR, then recomputes the content hash (SHA-256 over every tensor's raw little-endian bytes,
name-sorted) and compares it with the README's. The file hashes are printed for information: the
README's shards were written by torch's safetensors writer, whose byte layout we need not share.
Exit status 1 if the content hash differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from ced_jax.checkpoint.digest import file_sha256  # noqa: E402
from ced_jax.checkpoint.hf_loader import INDEX_NAME, content_sha256  # noqa: E402
from ced_jax.config import ModelConfig  # noqa: E402
from conversion.synthetic import write_synthetic_checkpoint  # noqa: E402

MID = REPO / "bench" / "configs" / "mid"
SEED = 3000
CONTENT_SHA256 = "01e2d4e53a4ccded6dfe6c551f70881fc9740dc126d3340145f0ef8ee955ac03"
TOTAL_SIZE = 939_003_956
FILE_SHA256 = {
    "model-00001-of-00003.safetensors": "c622fa9b457dd66a89cad574e0f2808c221fc01f1d519a2ca09ab7c822c320dd",
    "model-00002-of-00003.safetensors": "a2bb9862afc7b127bd4ca817992d18bd02b838e1ffdcc32165610776f773c7d2",
    "model-00003-of-00003.safetensors": "79890f6213d167850de8a6499e70dade39a4ac9e6176fa6f6dcc0aa1fb903a62",
    INDEX_NAME: "b2a261bc7e8198bc3d5321b3b203c574288fc81f09402e3648af2b143bc46794",
    "config.json": "defd182328b0c48d6d5c9071b2bdade10b5b30e10bb69e03561be578e45e0618",
}


def make_mid(out: Path, *, seed: int = SEED) -> dict[str, object]:
    cfg = ModelConfig.from_pretrained(MID)
    return write_synthetic_checkpoint(
        cfg, out, seed=seed, config_path=MID / "config.json",
        tokenizer_files=[MID / "tokenizer.json", MID / "tokenizer_config.json"],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory (about 0.94 GB)")
    ap.add_argument("--seed", type=int, default=SEED, help="README seed: 3000 (others skip the hash check)")
    ap.add_argument("--no-verify", action="store_true", help="skip the content-hash check")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    info = make_mid(args.out, seed=args.seed)
    print(f"wrote {info['tensors']} tensors, {info['total_size']:,} bytes, to {args.out} "
          f"in {time.perf_counter() - t0:.0f} s")
    if args.no_verify or args.seed != SEED:
        return 0
    ok = info["total_size"] == TOTAL_SIZE
    print(f"total_size {info['total_size']}: {'ok' if ok else f'expected {TOTAL_SIZE}'}")
    digest = content_sha256(args.out)
    match = digest == CONTENT_SHA256
    verdict = "matches the README" if match else f"MISMATCH, the README has {CONTENT_SHA256}"
    print(f"content sha256 {digest}: {verdict}")
    for name, want in FILE_SHA256.items():
        same = file_sha256(args.out / name) == want
        print(f"  {name}: {'same bytes as the README' if same else 'differs from the README file'}")
    return 0 if (match and ok) else 1


if __name__ == "__main__":
    sys.exit(main())
