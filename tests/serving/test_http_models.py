"""Model names of the HTTP API (serving/model_names.py): aliases, modes, headers, the unknown-name error,
and the per-name counter. Expected values are written out from api-surface.md §2 and RFC 9745."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client import CollectorRegistry

from serving.model_names import ModelAlias, ModelCatalog, ModelNames, UnknownModel, parse_alias


def _count(registry: CollectorRegistry, model: str, alias: str) -> float:
    value = registry.get_sample_value("ced_http_model_requests_total", {"model": model, "alias": alias})
    return 0.0 if value is None else value


def test_served_name_is_not_an_alias():
    r = ModelNames().resolve("deepseek-flash", "openai")
    assert (r.requested, r.served, r.thinking_override, r.deprecated, r.warning) == (
        "deepseek-flash", "deepseek-flash", None, False, None,
    )  # fmt: skip
    assert ModelCatalog.headers(r) == {}


@pytest.mark.parametrize(
    ("name", "thinking", "deprecated"),
    [
        ("deepseek-v4-flash", None, True),
        ("deepseek-v4-flash-vision-exp", None, True),
        ("DeepSeek-V4.1-Flash", None, False),
        ("deepseek-chat", False, True),
        ("deepseek-reasoner", True, True),
    ],
)
@pytest.mark.parametrize("route", ["openai", "anthropic"])
def test_default_aliases(name, thinking, deprecated, route):
    r = ModelNames().resolve(name, route)
    assert r.requested == name
    assert r.served == "deepseek-flash"
    assert r.thinking_override is thinking
    assert r.deprecated is deprecated
    assert "deepseek-flash" in r.warning and name in r.warning


def test_alias_headers_rfc9745_date():
    headers = ModelCatalog.headers(ModelNames().resolve("deepseek-chat", "openai"))
    # 2026-07-24 15:59:00 UTC = 1784908740 Unix seconds (date -d @1784908740 -u).
    assert headers["Deprecation"] == "@1784908740"
    assert headers["X-Ced-Served-Model"] == "deepseek-flash"
    assert "deepseek-chat" in headers["X-Ced-Model-Warning"]
    assert "thinking disabled" in headers["X-Ced-Model-Warning"]
    # 2026-09-10 04:00 UTC (12:00 Beijing, the V4.1-Flash launch) = 1789012800.
    assert (
        ModelCatalog.headers(ModelNames().resolve("deepseek-v4-flash", "openai"))["Deprecation"]
        == "@1789012800"
    )
    # Not deprecated: a warning, no Deprecation field.
    headers = ModelCatalog.headers(ModelNames().resolve("DeepSeek-V4.1-Flash", "openai"))
    assert "Deprecation" not in headers and "X-Ced-Model-Warning" in headers


def test_unknown_model_message_is_the_hosted_form():
    with pytest.raises(UnknownModel) as err:
        ModelNames().resolve("gpt-4o", "openai")
    expected = (
        "The supported API model names are DeepSeek-V4.1-Flash, deepseek-chat, deepseek-flash, "
        "deepseek-reasoner, deepseek-v4-flash, deepseek-v4-flash-vision-exp, but you passed gpt-4o."
    )
    assert str(err.value) == expected
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")


def test_names_are_case_sensitive_and_not_stripped():
    for name in ("Deepseek-Flash", "deepseek-flash ", "", None, 3):
        with pytest.raises(UnknownModel):
            ModelNames().resolve(name, "openai")


def test_claude_names_only_on_anthropic_routes():
    names = ModelNames()
    r = names.resolve("claude-sonnet-4-5", "anthropic")
    assert (r.served, r.thinking_override, r.deprecated, r.alias) == ("deepseek-flash", None, False, True)
    opus = names.resolve("claude-opus-4-1", "anthropic")
    assert "deepseek-v4-pro" in opus.warning
    with pytest.raises(UnknownModel) as err:
        names.resolve("claude-sonnet-4-5", "openai")
    assert "claude" not in str(err.value).split(", but")[0]
    with pytest.raises(UnknownModel) as err:
        names.resolve("gpt-4o", "anthropic")
    assert "claude-*" in str(err.value)
    with pytest.raises(UnknownModel):
        ModelNames(claude_on_anthropic=False).resolve("claude-sonnet-4-5", "anthropic")


def test_parse_alias():
    assert parse_alias("my-model") == ModelAlias("my-model", None)
    assert parse_alias("fast=non-thinking") == ModelAlias("fast", False)
    assert parse_alias("deep=thinking") == ModelAlias("deep", True)
    for bad, field in (("x=maybe", "'maybe'"), ("=thinking", "non-empty"), ("a b", "spaces")):
        with pytest.raises(ValueError, match=field):
            parse_alias(bad)


def test_extra_aliases_and_replacing_a_default():
    names = ModelNames(extra_aliases=(parse_alias("local-flash=non-thinking"), parse_alias("deepseek-chat")))
    r = names.resolve("local-flash", "openai")
    assert (r.thinking_override, r.deprecated) == (False, False)
    # The operator's deepseek-chat (no mode) replaces the default one (non-thinking, deprecated).
    r = names.resolve("deepseek-chat", "openai")
    assert (r.thinking_override, r.deprecated) == (None, False)
    assert "local-flash" in names.supported("openai")


def test_bad_alias_configs_are_refused():
    with pytest.raises(ValueError, match="served model name"):
        ModelNames(extra_aliases=(ModelAlias("deepseek-flash"),))
    with pytest.raises(ValueError, match="given twice"):
        ModelNames(extra_aliases=(ModelAlias("a"), ModelAlias("a", True)))
    with pytest.raises(ValueError, match="claude-"):
        ModelNames(extra_aliases=(ModelAlias("claude-x"),))
    with pytest.raises(ValueError, match="timezone-aware"):
        ModelAlias("x", deprecated_at=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="route"):
        ModelNames().resolve("deepseek-flash", "grpc")


def test_counter_per_requested_name():
    registry = CollectorRegistry()
    catalog = ModelCatalog(ModelNames(), registry)
    # Every configured name exists at 0 before any request, so a dashboard can show "no legacy traffic".
    assert (
        registry.get_sample_value(
            "ced_http_model_requests_total", {"model": "deepseek-v4-flash", "alias": "true"}
        )
        == 0.0
    )
    catalog.resolve("deepseek-flash", "openai")
    catalog.resolve("deepseek-chat", "openai")
    catalog.resolve("deepseek-chat", "anthropic")
    catalog.resolve("claude-haiku-4-5", "anthropic")
    catalog.resolve("claude-sonnet-4-5", "anthropic")
    with pytest.raises(UnknownModel):
        catalog.resolve("gpt-4o", "openai")
    with pytest.raises(UnknownModel):
        catalog.resolve("claude-haiku-4-5", "openai")
    assert _count(registry, "deepseek-flash", "false") == 1
    assert _count(registry, "deepseek-chat", "true") == 2
    assert _count(registry, "claude-*", "true") == 2
    assert _count(registry, "unknown", "false") == 2
    # A client-chosen name never becomes a label value.
    assert _count(registry, "gpt-4o", "false") == 0 and _count(registry, "claude-haiku-4-5", "true") == 0


def test_listed_models():
    assert ModelCatalog().listed() == [{"id": "deepseek-flash", "object": "model", "owned_by": "deepseek"}]


def test_deprecation_dates_are_utc_instants():
    # The header is an instant: the same moment written in another offset gives the same value.
    beijing = timezone(timedelta(hours=8))
    a = ModelAlias("x", deprecated_at=datetime(2026, 7, 24, 23, 59, tzinfo=beijing))
    r = ModelNames(extra_aliases=(a,)).resolve("x", "openai")
    assert ModelCatalog.headers(r)["Deprecation"] == "@1784908740"
