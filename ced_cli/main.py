"""`ced-jax` command line: describe, logits, generate, serve, compile, client, convert, plan,
train-draft (one module each; shared options in ced_cli.options).

`logits` and `generate` run on one device, or with `--mesh data=D,expert=E,tensor=T` on a device
mesh; `--coordinator/--num-processes/--process-id` join a multi-host run (jax.distributed), where
every process runs the same command and process 0 writes the outputs. `serve` runs multi-host the
same way: process 0 serves gRPC and schedules, the others run each step with it (serving.engine.multihost).

Errors a user can cause (bad paths, malformed configs or checkpoints, bad ids) print one line
naming the problem and exit with status 2; nothing is half-written (outputs are written to a
temporary file and renamed).
"""

from __future__ import annotations

import argparse
import sys

from ced_cli import convert, describe, generate, logits, plan, precompile, serve, train_draft
from ced_jax.config import RENAMED_PRESETS
from serving.cli_help import DefaultsHelp


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ced-jax", description="DeepSeek-V4.1-Flash in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (describe, logits, generate, serve, precompile):
        command.add_parser(sub)
    # Listed for --help only: main() hands `client ...` to serving.client.main before parsing.
    sub.add_parser("client", help="stream a completion from a ced-jax server (ced-jax client --help)")
    for command in (convert, plan, train_draft):
        command.add_parser(sub)
    for sub_parser in sub.choices.values():
        sub_parser.formatter_class = DefaultsHelp
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["client"]:  # the client has its own parser and needs no JAX
        from serving.client import main as client_main

        return client_main(argv[1:])
    args = build_parser().parse_args(argv)
    _use_current_preset_name(args, f"ced-jax {args.command}")
    return _run(args, f"ced-jax {args.command}")


def _use_current_preset_name(args, prog: str) -> None:
    """A renamed preset given as the model runs under its new name, with one stderr line saying so
    (a DeprecationWarning is not shown to a command's user)."""
    new = RENAMED_PRESETS.get(getattr(args, "model", None))
    if new is not None:
        print(f"{prog}: preset {args.model!r} is now {new!r}; the old name will be removed", file=sys.stderr)
        args.model = new


def _run(args, prog: str) -> int:
    try:
        return args.func(args)
    # ValueError covers the project's own input errors (ConfigError, CheckpointError, EngramConfigError,
    # ...); OSError a file the user named that cannot be read or written.
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2


def _one_line(message: str) -> str:
    """`message` with control characters escaped (a name the user typed may hold a newline), so that
    an error is always one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def convert_main(argv: list[str] | None = None) -> int:
    """The `convert_weights` console script: the same as `ced-jax convert`."""
    parser = argparse.ArgumentParser(
        prog="convert_weights",
        description="released HF checkpoint -> Orbax checkpoint (streaming)",
        formatter_class=DefaultsHelp,
    )
    convert.add_convert_options(parser)
    return _run(parser.parse_args(argv), prog="convert_weights")


if __name__ == "__main__":
    sys.exit(main())
