"""Keep-alive of slow non-streaming answers (`ServeConfig.http_keepalive_s`), as DeepSeek's hosted API
does while a request waits: the 200 and headers once the answer is not ready within the interval,
then an empty line every interval, then the JSON. Clients' read timeouts then measure silence, and
the official SDKs parse the body as they parse the hosted API's."""

from __future__ import annotations

import json
import time

import anthropic
import httpx2 as httpx
import openai
import pytest
from serving_helpers import GoldenTokenizer, ServerThread

from serving.config import ServeConfig
from serving.testing.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(300)

INTERVAL_S = 0.2
STEP_S = 0.05  # the mock engine's time per step: 40 tokens take about 2 s, ten intervals
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def served():
    shapes = dict(max_slots=4, page_size=16, num_pages=128, max_context=1024, prefill_buckets=(64,))
    engine = MockEngine(**shapes, vocab_size=640, max_logprobs=5, step_delay_s=STEP_S)
    engine.warmup()
    config = ServeConfig(
        **shapes, max_logprobs=5, max_tokens_limit=64, default_max_tokens=8, max_queued=8, metrics_port=None,
        http_port=0, http_keepalive_s=INTERVAL_S,
    )  # fmt: skip
    st = ServerThread(engine, GoldenTokenizer(), config)
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    yield st
    st.close()


def _chat(max_tokens: int) -> dict:
    return {
        "model": "deepseek-flash", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens, "ignore_eos": True, **NO_THINKING,
    }  # fmt: skip


def _timed(base: str, body: dict, path: str = "/v1/chat/completions"):
    """(status, seconds to the headers, [(seconds, bytes)] as they arrived, total seconds)."""
    chunks = []
    t0 = time.monotonic()
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        headers_s = time.monotonic() - t0
        for part in r.iter_raw():
            chunks.append((time.monotonic() - t0, part))
    return r.status_code, headers_s, chunks, time.monotonic() - t0


def test_a_slow_answer_gets_its_status_then_empty_lines_then_its_json(served):
    status, headers_s, chunks, total_s = _timed(served.base, _chat(40))
    raw = b"".join(part for _, part in chunks)
    assert status == 200
    assert total_s >= 40 * STEP_S and headers_s < total_s / 2  # the status came long before the answer
    lines = len(raw) - len(raw.lstrip(b"\n"))
    assert lines >= 3 and raw.lstrip(b"\n").startswith(b"{")
    # The lines came while the engine worked, not all at the end: one more each interval.
    assert chunks[0][0] < total_s / 2 and chunks[0][1].strip() == b""
    out = json.loads(raw)  # JSON parsers skip the leading whitespace
    assert out["usage"]["completion_tokens"] == 40 and out["choices"][0]["finish_reason"] == "length"
    served.assert_idle()
    assert served.server.http.admission.in_flight() == 0


def test_the_sdks_parse_a_kept_alive_answer(served):
    oai = openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=60)
    body = _chat(40)
    r = oai.chat.completions.create(
        model=body["model"], messages=body["messages"], max_tokens=40,
        extra_body={"ignore_eos": True, **NO_THINKING},
    )  # fmt: skip
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    claude = anthropic.Anthropic(
        base_url=f"{served.base}/anthropic", api_key="unused", max_retries=0, timeout=60
    )
    m = claude.messages.create(
        model="deepseek-flash", max_tokens=40, messages=[{"role": "user", "content": "hello"}],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert m.usage.output_tokens == 40 and m.stop_reason == "max_tokens"
    served.assert_idle()


def test_a_quick_answer_has_no_empty_lines(served):
    status, _, chunks, total_s = _timed(served.base, _chat(1))
    assert status == 200 and total_s < INTERVAL_S * 5
    assert b"".join(part for _, part in chunks).startswith(b"{")


def test_leaving_during_the_keep_alive_aborts_the_request(served):
    with httpx.stream("POST", served.base + "/v1/chat/completions", json=_chat(60), timeout=60) as r:
        assert r.status_code == 200
        first = next(r.iter_raw())
        assert first.strip() == b""  # an empty line: the answer is not ready
    # Closed after the first line: the engine request is aborted, its slot and pages freed long
    # before its 60 tokens (3 s) would have been generated, and its admission given back.
    t0 = time.monotonic()
    served.assert_idle(timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert served.server.http.admission.in_flight() == 0
