"""`convert_weights` / `ced-jax convert` once its arguments are parsed (the parser is ced_cli.convert's)."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from conversion.convert import convert
from conversion.interrupt import Interrupted, signals_interrupt
from conversion.options import ConversionError, ConvertOptions
from conversion.save_noise import closed_loop_tracebacks_dropped


def run(args: argparse.Namespace) -> int:
    """Run a conversion from the parsed `ced-jax convert` / `convert_weights` arguments (defined in
    ced_cli.convert); prints a JSON summary on stdout."""
    prog = getattr(args, "prog", "convert_weights")
    options = ConvertOptions(
        include=None if getattr(args, "include", None) is None else tuple(args.include.split(",")),
        engram=args.engram,
        weights_dtype=args.weights_dtype,
        overwrite=args.overwrite,
        progress=not args.quiet,
        compression=not args.no_compression,
        engram_raw=not getattr(args, "no_engram_raw", False),
    )
    try:
        with signals_interrupt(), closed_loop_tracebacks_dropped():
            summary = convert(args.hf_dir, args.out, options)
    except OSError as e:  # disk full, permissions: one line, like every other user-facing error
        raise ConversionError(f"{e.filename or args.out}: {e.strerror or e}") from None
    except Interrupted as e:
        # convert() has removed its temporary directory on the way out (it re-raises after clean-up).
        print(
            f"{prog}: interrupted by {signal.Signals(e.signum).name}; --out {args.out} left as it was, "
            "temporary files removed",
            file=sys.stderr,
        )
        return 128 + e.signum  # the shell's status for a process ended by that signal
    print(json.dumps(summary))
    return 0
