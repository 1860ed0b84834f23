"""Model names of the HTTP API: the served name, its aliases, and what each alias means.

One model is served, under the hosted API's name `deepseek-flash` (api-surface.md §2). Clients migrating
from the hosted API may still send older names; those are accepted as aliases:

| name | thinking | deprecated (RFC 9745 date) |
|---|---|---|
| `deepseek-v4-flash`, `deepseek-v4-flash-vision-exp` | as requested | 2026-09-10 04:00 UTC (1) |
| `DeepSeek-V4.1-Flash` | as requested | no: the model's own name (the one deepseek-recipe accepts) |
| `deepseek-chat` | disabled | 2026-07-24 15:59 UTC (hosted docs) |
| `deepseek-reasoner` | enabled | 2026-07-24 15:59 UTC |
| `claude-*`, Anthropic routes only | off unless asked (Anthropic's default) | no: a mapping (hosted) |

(1) The V4.1-Flash launch (12:00 Beijing, when its pricing took effect); since then the hosted API serves
these retired names with V4.1-Flash as a compatibility route (seeds).

The hosted Anthropic endpoint maps `claude-opus*` to deepseek-v4-pro, which is not served here; it is
served by deepseek-flash like every other `claude-*` name (refusing it would break Claude-style clients
that default to opus), and the warning header says so. Operators add aliases with a CLI value
`NAME` or `NAME=thinking|non-thinking` (`parse_alias`); an added name replaces a default of the same
name.

Headers of an aliased answer (`ModelCatalog.headers`):
- `Deprecation: @<unix seconds>` for a deprecated name. RFC 9745 defines the field as a Structured
  Field Date only; the `Deprecation: true` form was in the drafts and is not valid under the RFC, and
  the date tells a client how long the name has been on borrowed time.
- `X-Ced-Model-Warning: <text>` on every alias, naming the served model. Not `Warning`: RFC 9111
  obsoleted that field and clients drop it.
- `X-Ced-Served-Model: deepseek-flash`: the body's `model` echoes the requested name (as the hosted API
  does), so this is where a client sees what served it.

An unknown name raises `UnknownModel`, whose message is the hosted form with the names sorted as
deepseek-recipe sorts them; issue 11 asks for a 404 in the route's error format (the hosted API says
400; 404 is what the OpenAI API answers for an unknown model, and what the SDKs type as NotFoundError).

`ModelCatalog` counts requests per requested name in `ced_http_model_requests_total{model, alias}`.
The label takes only bounded values: the served name, the configured aliases, `claude-*` for every
Claude name, and `unknown` for anything else (a client-chosen string must not create a time series).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Literal

from prometheus_client import CollectorRegistry, Counter

Route = Literal["openai", "anthropic"]
ROUTES: tuple[str, ...] = ("openai", "anthropic")

SERVED_MODEL = "deepseek-flash"
CLAUDE_PREFIX = "claude-"
DEPRECATION_HEADER = "Deprecation"
WARNING_HEADER = "X-Ced-Model-Warning"
SERVED_MODEL_HEADER = "X-Ced-Served-Model"
# Metric label values for names that are not configured (bounded cardinality, see the module doc).
CLAUDE_LABEL = "claude-*"
UNKNOWN_LABEL = "unknown"

_V41_LAUNCH = datetime(2026, 9, 10, 4, 0, tzinfo=UTC)  # 12:00 Beijing, pricing effective
_CHAT_REASONER_DEPRECATED = datetime(2026, 7, 24, 15, 59, tzinfo=UTC)
_THINKING_VALUES = {"thinking": True, "non-thinking": False}


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: the name must be a non-empty string, got {name!r}")
    if not name.isprintable() or any(c.isspace() for c in name) or "=" in name:
        raise ValueError(f"{what} {name!r}: the name must be printable, without spaces or '='")


@dataclasses.dataclass(frozen=True)
class ModelAlias:
    """A name accepted for the served model; `thinking` forces the mode (None: the request decides)."""

    name: str
    thinking: bool | None = None
    deprecated_at: datetime | None = None  # aware; None: not deprecated

    def __post_init__(self):
        _check_name(self.name, "model alias")
        if self.deprecated_at is not None and self.deprecated_at.utcoffset() is None:
            raise ValueError(f"model alias {self.name!r}: deprecated_at must be timezone-aware")


DEFAULT_ALIASES: tuple[ModelAlias, ...] = (
    ModelAlias("deepseek-v4-flash", deprecated_at=_V41_LAUNCH),
    ModelAlias("deepseek-v4-flash-vision-exp", deprecated_at=_V41_LAUNCH),
    ModelAlias("DeepSeek-V4.1-Flash"),
    ModelAlias("deepseek-chat", thinking=False, deprecated_at=_CHAT_REASONER_DEPRECATED),
    ModelAlias("deepseek-reasoner", thinking=True, deprecated_at=_CHAT_REASONER_DEPRECATED),
)


def parse_alias(value: str) -> ModelAlias:
    """A CLI value `NAME` or `NAME=thinking|non-thinking` as a ModelAlias (not deprecated)."""
    name, sep, mode = value.partition("=")
    if not sep:
        return ModelAlias(name.strip())
    mode = mode.strip()
    if mode not in _THINKING_VALUES:
        raise ValueError(
            f"model alias {value!r}: the mode after '=' must be 'thinking' or 'non-thinking', got {mode!r}"
        )
    return ModelAlias(name.strip(), thinking=_THINKING_VALUES[mode])


class UnknownModel(Exception):
    """The requested model is not served; the message is the hosted API's wording.

    `status`, `param` and `code` are what the front end puts in the route's error body.
    """

    status = 404
    param = "model"
    code = "model_not_found"

    def __init__(self, message: str, requested: object):
        super().__init__(message)
        self.message = message
        self.requested = requested


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A requested model name, resolved. `requested` is what the response's `model` echoes."""

    requested: str
    served: str
    thinking_override: bool | None  # forced by the name (deepseek-chat / deepseek-reasoner)
    deprecated: bool
    warning: str | None  # None for the served name itself
    deprecated_at: datetime | None = None
    alias: bool = False
    default_thinking: bool = True  # without a `thinking` field: claude-* names follow Anthropic (off)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelNames:
    """The names the HTTP API accepts (a frozen config; `ServeConfig` nests it)."""

    served: str = SERVED_MODEL
    default_aliases: tuple[ModelAlias, ...] = DEFAULT_ALIASES
    extra_aliases: tuple[ModelAlias, ...] = ()  # operator's; replace a default of the same name
    claude_on_anthropic: bool = True  # accept `claude-*` on the Anthropic routes

    def __post_init__(self):
        _check_name(self.served, "served model")
        seen: set[str] = set()
        for a in self.extra_aliases:
            if a.name == self.served:
                raise ValueError(f"model alias {a.name!r}: it is the served model name, not an alias")
            if a.name in seen:
                raise ValueError(f"model alias {a.name!r}: given twice")
            seen.add(a.name)
        if self.claude_on_anthropic and any(a.name.startswith(CLAUDE_PREFIX) for a in self.extra_aliases):
            # It would take precedence on one route and not the other: ambiguous, so refuse it.
            raise ValueError(f"model aliases: names starting with {CLAUDE_PREFIX!r} are mapped already")

    @property
    def aliases(self) -> dict[str, ModelAlias]:
        """Every alias by name: the defaults, then the extra ones (replacing defaults of the same name)."""
        table = {a.name: a for a in self.default_aliases if a.name != self.served}
        table.update((a.name, a) for a in self.extra_aliases)
        return table

    def supported(self, route: Route) -> list[str]:
        """The accepted names on a route, sorted (the order of the hosted error message)."""
        names = [self.served, *self.aliases]
        if route == "anthropic" and self.claude_on_anthropic:
            names.append(CLAUDE_PREFIX + "*")
        return sorted(names)

    def resolve(self, name: object, route: Route) -> Resolved:
        """The requested name resolved on a route (`openai` or `anthropic`); UnknownModel if not served."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        if isinstance(name, str):
            if name == self.served:
                return Resolved(name, self.served, None, False, None)
            alias = self.aliases.get(name)
            if alias is not None:
                return self._alias(name, alias.thinking, alias.deprecated_at)
            if route == "anthropic" and self.claude_on_anthropic and name.startswith(CLAUDE_PREFIX):
                note = ""
                if name.startswith(CLAUDE_PREFIX + "opus"):
                    note = (
                        " (the hosted API routes claude-opus* to deepseek-v4-pro, which is not served here)"
                    )
                return self._alias(name, None, None, note, default_thinking=False)
        shown = name if isinstance(name, str) else repr(name)
        raise UnknownModel(
            f"The supported API model names are {', '.join(self.supported(route))}, but you passed {shown}.",
            name,
        )

    def _alias(
        self,
        name: str,
        thinking: bool | None,
        deprecated_at: datetime | None,
        note: str = "",
        default_thinking: bool = True,
    ) -> Resolved:
        mode = {None: "", True: " with thinking enabled", False: " with thinking disabled"}[thinking]
        warning = f"model {name!r} is an alias: served by {self.served!r}{mode}{note}"
        if deprecated_at is not None:
            warning += f"; deprecated since {deprecated_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
            warning += f", use {self.served!r}"
        return Resolved(
            name,
            self.served,
            thinking,
            deprecated_at is not None,
            warning,
            deprecated_at=deprecated_at,
            alias=True,
            default_thinking=default_thinking,
        )


def deprecation_value(when: datetime) -> str:
    """RFC 9745 `Deprecation` field value: a Structured Field Date, `@` + integer Unix seconds."""
    return f"@{int(when.timestamp())}"


def _ascii(text: str) -> str:
    # Header values must be latin-1 safe for ASGI servers; a configured alias may not be.
    return text.encode("ascii", "backslashreplace").decode("ascii")


class ModelCatalog:
    """`ModelNames` with the request counter: what the front end calls for every request."""

    def __init__(self, names: ModelNames | None = None, registry: CollectorRegistry | None = None):
        self.names = names or ModelNames()
        self.requests = Counter(
            "ced_http_model_requests",
            "HTTP requests per requested model name (claude-*: all Claude names; unknown: not served).",
            ["model", "alias"],
            registry=registry if registry is not None else CollectorRegistry(),
        )
        self.requests.labels(model=self.names.served, alias="false")
        for name in self.names.aliases:
            self.requests.labels(model=name, alias="true")

    def resolve(self, name: object, route: Route) -> Resolved:
        """`ModelNames.resolve`, counted (unknown names count under `unknown`, then raise)."""
        try:
            resolved = self.names.resolve(name, route)
        except UnknownModel:
            self.requests.labels(model=UNKNOWN_LABEL, alias="false").inc()
            raise
        if not resolved.alias:
            label = resolved.requested
        elif resolved.requested in self.names.aliases:
            label = resolved.requested
        else:  # a claude-* name: one series for all of them
            label = CLAUDE_LABEL
        self.requests.labels(model=label, alias="true" if resolved.alias else "false").inc()
        return resolved

    @staticmethod
    def headers(resolved: Resolved) -> dict[str, str]:
        """Response headers for a resolved name: none for the served name (see the module doc)."""
        if not resolved.alias:
            return {}
        out = {SERVED_MODEL_HEADER: _ascii(resolved.served)}
        if resolved.warning:
            out[WARNING_HEADER] = _ascii(resolved.warning)
        if resolved.deprecated_at is not None:
            out[DEPRECATION_HEADER] = deprecation_value(resolved.deprecated_at)
        return out

    def listed(self) -> list[dict]:
        """`GET /v1/models` entries: the served name only (aliases are for migration, not discovery)."""
        return [{"id": self.names.served, "object": "model", "owned_by": "deepseek"}]
