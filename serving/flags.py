"""Command-line flags declared on config fields (`flag`): `ced-jax serve` generates its arguments from
them (ced_cli.serve), and a config's errors name a field with its flag (`named`), so a flag is
declared once, beside the value it sets. Here, below every config, so that the nested configs
(files, image fetching, admission limits) declare theirs too."""

from __future__ import annotations

import dataclasses

# The sections of `ced-jax serve --help`, in order.
SHAPES = "shapes (static: compiled at start-up)"
SCHEDULING = "scheduling"
ADMISSION = "admission"
TENANTS = "tenants"
SERVER = "server"
IMAGES = "images (a model with a vision tower; gRPC and HTTP alike)"
FLAG_GROUPS = (SHAPES, SCHEDULING, ADMISSION, TENANTS, SERVER, IMAGES)


@dataclasses.dataclass(frozen=True)
class Flag:
    """A config field's `ced-jax serve` flag: the CLI's parser and the config it builds are generated
    from these (`ced_cli`). The flag's type and default are the field's; a bool field with default
    True also gets its --no- form."""

    name: str
    help: str
    group: str
    metavar: str | None = None


def flag(default, name: str, help: str, *, group: str, metavar: str | None = None):
    """A field with its `Flag` (see above)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(name, help, group, metavar)})


def named(config, field: str) -> str:
    """`field` of a config (class or instance) as its errors name it: "max_bytes (--image-url-max-bytes)"
    when the field has a flag, else the field alone."""
    declared = next(f for f in dataclasses.fields(config) if f.name == field).metadata.get("flag")
    return field if declared is None else f"{field} ({declared.name})"
