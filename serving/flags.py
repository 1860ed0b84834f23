"""Command-line flags declared on config fields (`flag`): `ced-jax serve` generates its arguments from
them (ced_cli.serve), and a config's errors name a field with its flag (`named`), so a flag is
declared once, beside the value it sets. Here, below every config, so that the nested configs
(files, image fetching, admission limits) declare theirs too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# The sections of `ced-jax serve --help`, in order.
SHAPES = "shapes (static: compiled at start-up)"
SCHEDULING = "scheduling"
ADMISSION = "admission"
TENANTS = "tenants"
SERVER = "server"
IMAGES = "images (a model with a vision tower; gRPC and HTTP alike)"
FLAG_GROUPS = (SHAPES, SCHEDULING, ADMISSION, TENANTS, SERVER, IMAGES)

# `--max-context` / `--max-tokens-limit auto`: sized by the command from the model and the memory.
AUTO = "auto"

# What --prefill-mode's two values do; `serve`'s flag (ServeConfig.prefill_mode) and those of `logits`
# and `generate` (ced_cli.options) say it with these words.
PREFILL_MODE_HELP = (
    "exact: every layer over every prompt token (the reference's numbers); ced: the causal "
    "encoder-decoder prefill (spec 4.2), the encoder layers over the whole prompt and the decoder "
    "layers only over its last sliding window (about half the prefill work on long prompts, not "
    "bit-identical). Default %(default)s"
)


@dataclasses.dataclass(frozen=True)
class Flag:
    """A config field's `ced-jax serve` flag: the CLI's parser and the config it builds are generated
    from these (`ced_cli.serve`). The flag's type and default are the field's unless said below; a
    bool field with default True also gets its --no- form."""

    name: str
    help: str
    group: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # The command's default, as typed, where it is not the field's: the ports (the command listens
    # on the well-known ones, a server started in-process on any free one), "auto", or a field whose
    # value is not typed as such (--prefill-chunk 128 is prefill_buckets (128,)). None: the field's.
    command_default: str | None = None
    # The typed text to the field's value, for a flag typed otherwise than its field (a comma list,
    # "auto", a port that -1 turns off); a ValueError is the command's error, naming field and flag.
    # A repeatable flag's parse takes the list of its texts. None: the field's type reads the text.
    parse: Callable | None = None
    repeatable: bool = False
    # Other fields of the same config that the flag sets when given, (name, value) pairs: e.g.
    # --allow-image-urls names the hosts and turns fetching on.
    also: tuple[tuple[str, object], ...] = ()


def flag(default, name: str, help: str, *, group: str, **declared):
    """A field with its `Flag` (see above; `declared`: its optional attributes)."""
    return flags(default, Flag(name, help, group, **declared))


def flags(default, *declared: Flag):
    """A field that several flags set, one or the other (e.g. an API key, or a file of them)."""
    return dataclasses.field(default=default, metadata={"flags": declared})


def named(config, field: str) -> str:
    """`field` of a config (class or instance) as its errors name it: "max_bytes (--image-url-max-bytes)"
    when the field has a flag, else the field alone."""
    declared = next(f for f in dataclasses.fields(config) if f.name == field).metadata.get("flags")
    return field if not declared else f"{field} ({' / '.join(f.name for f in declared)})"


# Parsers of typed text (`Flag.parse`); each ValueError says what was expected.
def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def whole_number_or_auto(text: str) -> int | str:
    """A whole number, or AUTO (left to the command to size)."""
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number or {AUTO}, got {text!r}") from None


def whole_numbers(example: str) -> Callable[[str], tuple[int, ...]]:
    """A parser of comma-separated whole numbers, such as `example`, to a tuple."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(
                f"expected comma-separated whole numbers, e.g. {example}, got {text!r}"
            ) from None

    return parse


def port_or_off(*off: int) -> Callable[[str], int | None]:
    """A parser of a port number, None (off) for the numbers `off`."""

    def parse(text: str) -> int | None:
        port = whole_number(text)
        return None if port in off else port

    return parse
