"""`ced-jax convert` and the `convert_weights` script: a released HF checkpoint -> an Orbax checkpoint
(conversion.convert)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="released HF checkpoint -> Orbax checkpoint (as convert_weights)")
    add_convert_options(p)


def run(args) -> int:
    from conversion.cli import run as convert

    return convert(args)


def add_convert_options(p: argparse.ArgumentParser) -> None:
    """`ced-jax convert` and `convert_weights` (here, not in conversion.convert, so that building
    the parser stays free of JAX imports)."""
    p.add_argument("--hf-dir", required=True, help="released-layout checkpoint (index + safetensors shards)")
    p.add_argument(
        "--out",
        required=True,
        help="output directory; must not exist, or with --overwrite be a previous conversion (or empty)",
    )
    p.add_argument(
        "--include",
        default=None,
        help="comma-separated parts: text, dspark, vision (written as separate host-side items); "
        "default: text, plus vision when config.json has a vision tower and dspark when it has DSpark "
        "stages whose mtp.* tensors the index lists",
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out that is a previous conversion (has ced_manifest.json) or empty",
    )
    p.add_argument("--no-compression", action="store_true", help="store chunks uncompressed (faster)")
    p.add_argument(
        "--no-engram-raw",
        action="store_true",
        help="do not also write the Engram tables as raw memory-mappable files (engram_raw/; they let "
        "a host-placement load skip reading the tables into RAM, at twice their disk space)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run, command="convert", prog=p.prog)  # prog: for the interruption line
