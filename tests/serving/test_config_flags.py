"""Issue 32: a serve flag is declared once, on the config field it sets (`serving.flags`), and the
config checks its own values: a bad value is a ValueError from ServeConfig (or the nested config)
itself, naming the field and its flag, whoever built the config (the CLI or a program)."""

from __future__ import annotations

import pytest

from serving.config import ServeConfig
from serving.flags import AUTO, named, port_or_off, whole_number, whole_number_or_auto, whole_numbers
from serving.image_fetch import ImageFetchConfig

BAD_VALUES = [
    (dict(max_context=100), "max_context (--max-context) must be a multiple of page_size (--page-size) 16"),
    (dict(max_context=0), "max_context (--max-context) must be >= 1, got 0"),
    (dict(max_slots=0), "max_slots (--max-slots) must be >= 1, got 0"),
    (dict(page_size=0), "page_size (--page-size) must be >= 1, got 0"),
    (dict(num_pages=0), "num_pages (--num-pages) must be >= 1, got 0"),
    (dict(prefill_buckets=(0,)), "prefill_buckets (--prefill-chunk) must be ascending, each >= 1, got (0,)"),
    (
        dict(prefill_buckets=(20,)),
        "the largest of prefill_buckets (--prefill-chunk) must be a multiple of page_size (--page-size) 16, "
        "got 20",
    ),
    (
        dict(prefill_rows=(4, 2)),
        "prefill_rows (--prefill-rows) must be ascending row counts in 1..max_slots (--max-slots) 32, "
        "got (4, 2)",
    ),
    (dict(prefill_rows=(0,)), "prefill_rows (--prefill-rows) must be ascending row counts in 1..max_slots"),
    (dict(max_slots=2, prefill_rows=(1, 4)), "1..max_slots (--max-slots) 2, got (1, 4)"),
    (dict(prefill_rows=(2, 4)), "prefill_rows (--prefill-rows) [2, 4]: several prefill sizes break batch"),
    (
        dict(decode_context_buckets=(24, 2048)),
        "decode_context_buckets (--decode-context-buckets) must be ascending multiples of page_size "
        "(--page-size) 16, at most max_context (--max-context) 2048, got (24, 2048)",
    ),
    (dict(decode_context_buckets=(512, 256)), "decode_context_buckets (--decode-context-buckets) must be"),
    (dict(decode_context_buckets=(4096,)), "at most max_context (--max-context) 2048, got (4096,)"),
    (dict(max_tokens_limit=0), "max_tokens_limit (--max-tokens-limit) must be >= 1, got 0"),
    (dict(max_tokens_limit=100), "default_max_tokens 256 must not exceed max_tokens_limit (--max-tokens"),
    (dict(prefill_mode="fast"), "prefill_mode (--prefill-mode) must be one of ['exact', 'ced'], got 'fast'"),
    (dict(port=-1), "port (--port) must be in 0..65535 (0: any free port), got -1"),
    (dict(port=65536), "port (--port) must be in 0..65535"),
    (dict(metrics_port=-1), "metrics_port (--metrics-port) must be in 0..65535 (0: any free port), or None"),
    (dict(http_port=70000), "http_port (--http-port) must be in 0..65535 (0: any free port), or None (off)"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "message"), BAD_VALUES)
def test_serve_config_refuses_a_bad_value_naming_field_and_flag(values, message):
    with pytest.raises(ValueError) as e:
        ServeConfig(**values)
    assert message in str(e.value)


def test_image_fetch_config_names_the_allow_image_urls_flag():
    for hosts in (("",), ("a/b",), (" a",), ()):
        with pytest.raises(ValueError, match=r"allowed_hosts \(--allow-image-urls\)"):
            ImageFetchConfig(allow_image_urls=True, allowed_hosts=hosts)


def test_context_buckets_end_at_max_context():
    """Widths below max_context get max_context added (what --decode-context-buckets always said)."""
    assert ServeConfig(max_context=2048, decode_context_buckets=(512,)).decode_context_buckets == (512, 2048)
    assert ServeConfig(max_context=2048, decode_context_buckets=(512, 2048)).decode_context_buckets == (
        512,
        2048,
    )


def test_named_spells_every_flag_of_a_field():
    assert named(ServeConfig, "api_keys") == "api_keys (--api-key / --api-key-file)"
    assert named(ServeConfig, "prefill_buckets") == "prefill_buckets (--prefill-chunk)"
    assert named(ServeConfig, "max_stop_strings") == "max_stop_strings"  # no flag
    assert named(ImageFetchConfig, "allowed_hosts") == "allowed_hosts (--allow-image-urls)"


def test_flag_parsers():
    assert whole_number("12") == 12
    assert whole_number_or_auto(AUTO) == AUTO and whole_number_or_auto("-3") == -3
    assert whole_numbers("2,4")("2,4") == (2, 4) and whole_numbers("4")("8") == (8,)
    metrics, http = port_or_off(-1), port_or_off(0, -1)
    assert (metrics("-1"), metrics("0"), metrics("-2")) == (None, 0, -2)  # -2: ServeConfig refuses it
    assert (http("0"), http("-1"), http("8000")) == (None, None, 8000)
    for parse, text, message in (
        (whole_number, "1.5", "expected a whole number, got '1.5'"),
        (whole_number_or_auto, "lots", "expected a whole number or auto, got 'lots'"),
        (whole_numbers("2,4"), "2,,4", "expected comma-separated whole numbers, e.g. 2,4, got '2,,4'"),
        (metrics, "off", "expected a whole number, got 'off'"),
    ):
        with pytest.raises(ValueError) as e:
            parse(text)
        assert str(e.value) == message
