"""The prefill mode of a request (`--prefill-mode`, gRPC `prefill_mode`, the HTTP body's
`prefill_mode`): validation with the field named, and what the scheduler hands the engine (each
chunk's `decoder_from`: the start of the prompt's last window for a CED request, 0 for exact, on a
prefix hit's replayed chunks too). The model side is
tests/ced_jax/test_ced_prefill.py; the real engine over gRPC, tests/serving/test_serving_jax.py."""

from __future__ import annotations

import json

import pytest
from serving_helpers import http_converter, make_engine_and_config, request, run_until_idle

from serving.config import ServeConfig
from serving.errors import InvalidRequest
from serving.http.convert import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from serving.http.errors import ApiError
from serving.scheduling.scheduler import Scheduler
from serving.testing.mock_engine import ByteTokenizer
from tests.conftest import GOLDEN_TINY_V


class _Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)


def _scheduler(**kw):
    engine, cfg = make_engine_and_config(**kw)
    chunks = []
    prefill_async = engine.prefill_async

    def record(batch):
        chunks.extend(batch)
        return prefill_async(batch)

    engine.prefill_async = record
    return Scheduler(engine, ByteTokenizer(), cfg), chunks


def test_ced_request_chunks_carry_the_decoder_window():
    sched, chunks = _scheduler(ced_window=8, replay_tokens=8)
    prompt = list(range(3, 3 + 37))
    sched.submit(request("ced", prompt, max_tokens=2, prefill_mode="ced"), _Recorder())
    run_until_idle(sched)
    assert chunks and all(c.decoder_from == 37 - 8 for c in chunks)
    chunks.clear()
    sched.submit(request("exact", prompt[::-1], max_tokens=2, prefill_mode="exact"), _Recorder())
    run_until_idle(sched)
    assert chunks and all(c.decoder_from == 0 for c in chunks)
    # A longer CED prompt with the first one's prefix: a hit of 36 tokens, replayed from 28 with the
    # new prompt's own decoder window.
    chunks.clear()
    sched.submit(request("ced2", prompt + [9] * 8, max_tokens=2, prefill_mode="ced"), _Recorder())
    run_until_idle(sched)
    assert chunks[0].start_pos == chunks[0].window_floor == 28 and chunks[0].write_from == 36
    assert all(c.decoder_from == 45 - 8 and c.write_from == 36 for c in chunks)


def test_server_default_and_short_prompts():
    sched, chunks = _scheduler(ced_window=8, prefill_mode="ced")
    sched.submit(request("default", list(range(3, 23)), max_tokens=2), _Recorder())
    sched.submit(request("short", list(range(3, 9)), max_tokens=2), _Recorder())  # within the window
    run_until_idle(sched)
    by_len = {len(c.token_ids) + c.start_pos: c.decoder_from for c in chunks if c.is_last_chunk}
    assert by_len == {20: 12, 6: 0}


def test_bad_or_unsupported_modes_name_the_field():
    sched, _ = _scheduler(ced_window=8)
    with pytest.raises(InvalidRequest, match="must be one of") as e:
        sched.submit(request("x", [3, 4, 5], prefill_mode="fast"), _Recorder())
    assert e.value.field == "prefill_mode"
    plain, _ = _scheduler()  # a model without the CED layout
    with pytest.raises(InvalidRequest, match="no CED layout") as e:
        plain.submit(request("y", [3, 4, 5], prefill_mode="ced"), _Recorder())
    assert e.value.field == "prefill_mode"
    with pytest.raises(ValueError, match="prefill_mode"):
        ServeConfig(prefill_mode="fast")


@pytest.fixture(scope="module")
def converter():
    return http_converter(GOLDEN_TINY_V / "tokenizer.json")


_BODIES = {
    CHAT: {"messages": [{"role": "user", "content": "hi"}]},
    RESPONSES: {"input": "hi"},
    MESSAGES: {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"prompt": "def f(", "suffix": "):"},
}


@pytest.mark.parametrize("api", list(_BODIES))
def test_http_bodies_carry_the_mode(converter, api):
    body = {"model": "deepseek-flash", **_BODIES[api]}
    if api == COMPLETIONS:
        body["model"] = "deepseek-v4-flash"
    assert converter.prepare(api, json.dumps(body).encode()).prefill_mode is None
    p = converter.prepare(api, json.dumps({**body, "prefill_mode": "ced"}).encode())
    assert p.prefill_mode == "ced"
    with pytest.raises(ApiError) as e:
        converter.prepare(api, json.dumps({**body, "prefill_mode": "fast"}).encode())
    assert e.value.status == 400 and e.value.param == "prefill_mode"
