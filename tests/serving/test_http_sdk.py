"""The HTTP API through the official `openai` and `anthropic` SDKs, unmodified, over localhost.

One real server for the module: the tiny model (random weights) on JaxEngine, gRPC and HTTP in one
process and event loop (`serving.server.Server` with `http_port=0`). The model's output means nothing,
so the tests check structure and exactness: the prompt the server encoded (usage.prompt_tokens equals
the length of our chat layer's rendering of the same request), the answer equals greedy generation of
the engine over gRPC for that prompt (decoded and split at `</think>` here), the SDKs' typed
exceptions for each error status.
"""

from __future__ import annotations

import json
import threading

import anthropic
import httpx2 as httpx
import jsonschema
import openai
import pytest
import tokenizers
from serving_helpers import ServerThread

import ced_jax
from ced_jax.chat import PromptEncoder, RenderedPrompt
from serving import client as grpc_client
from serving.admission import AdmissionLimits
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.tenants import ApiKeys
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(900)

SLOTS, PAGE, CONTEXT, CHUNK = 4, 16, 2048, 64
KEY = "sk-test-0123456789"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather for a city",
        "parameters": {
            "type": "object",
            # Bounded (as in tests/serving/test_constraints_engine.py), so the random model can finish a call.
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}
NO_THINKING = {"thinking": {"type": "disabled"}}
IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def model():
    return ced_jax.load("tiny")


@pytest.fixture(scope="module")
def server(model):
    config = ServeConfig(
        max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,), max_tokens_limit=512,
        default_max_tokens=16, max_queued=8, metrics_port=None, http_port=0,
        api_keys=ApiKeys.parse([f"{KEY} tester"]),
        # One effort-max request at a time and no queue for more, so the test can fill that tier.
        http_limits=AdmissionLimits(max_tier_concurrent=1, max_tier_queue=0),
    )  # fmt: skip
    engine = JaxEngine(model, config)
    engine.warmup()  # compiles here: ServerThread gives start() 30 s
    st = ServerThread(engine, ModelTokenizer(model), config)
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    yield st
    st.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base + "/anthropic", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(model):
    return tokenizers.Tokenizer.from_file(str(model.tokenizer_path))


def _engine_tokens(server, ids: list[int], max_tokens: int, **sampling) -> list[int]:
    """The engine's tokens for `ids` over gRPC (greedy unless told; the stop token is not sent)."""
    sampling.setdefault("temperature", 0.0)
    out = grpc_client.generate(server.addr, ids, max_tokens=max_tokens, api_key=KEY, **sampling)
    return list(out.token_ids)


def _encode(hf, prompt: str, specials: list[str]) -> list[int]:
    """Token ids of a prompt written out by hand, `specials` being its control tokens in order."""
    ranges, pos = [], 0
    for s in specials:
        i = prompt.index(s, pos)
        ranges.append((i, i + len(s)))
        pos = i + len(s)
    return PromptEncoder(hf).encode(RenderedPrompt(prompt, [], ranges))


def _hidden(hf) -> set[int]:
    """Special tokens no text field shows: all but the markers the stream parser reads."""
    parsed = ("<think>", "</think>", "｜DSML｜")
    return {i for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content not in parsed}


def _shown(hf, ids: list[int]) -> str:
    """The text of generated ids as the HTTP API shows it (hidden special tokens left out)."""
    hidden = _hidden(hf)
    return hf.decode([t for t in ids if t not in hidden], skip_special_tokens=False)


def _split_thinking(hf, ids: list[int]) -> tuple[str, str]:
    """(reasoning, answer) of a thinking-mode completion: the text before / after `</think>`."""
    end = hf.token_to_id("</think>")
    if end in ids:
        i = ids.index(end)
        return _shown(hf, ids[:i]), _shown(hf, ids[i + 1 :])
    return _shown(hf, ids), ""


# ---------------------------------------------------------------------------------------------- chat


def test_chat_non_thinking_is_greedy_generation_of_the_rendered_prompt(server, oai, hf):
    r = oai.chat.completions.create(
        model="deepseek-flash",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=0,
        extra_body=NO_THINKING,
    )
    # The exact prompt of spec §16.3 (non-thinking), encoded with our chat layer's encoder.
    prompt = "<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>Hello<｜Assistant｜></think>"
    ids = _encode(
        hf, prompt, ["<｜begin▁of▁sentence｜>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "</think>"]
    )
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_cache_hit_tokens + r.usage.prompt_cache_miss_tokens == len(ids)
    expected = _engine_tokens(server, ids, 12)
    text = _shown(hf, expected)
    # deepseek-recipe drops leading newlines of an answer and an incomplete UTF-8 sequence at its end
    # (the tokenizer decodes that to U+FFFD).
    assert r.choices[0].message.content == text.lstrip("\n").rstrip("\ufffd")
    finish = r.choices[0].finish_reason
    assert finish in ("stop", "length")
    # The engine's count: every generated token, the stop token (never sent) included.
    assert r.usage.completion_tokens == len(expected) + (finish == "stop")
    assert r.model == "deepseek-flash" and r.object == "chat.completion"
    server.assert_idle()


def _plain_stop(hf, text: str, size: int = 3) -> str:
    """A `size`-character stop string from the middle of `text` that is ordinary token text: the
    answer shows special tokens the random model emits spelled out (`<｜User｜>`), but deepseek-recipe
    matches stop strings only in the text of ordinary tokens, so a string reaching into one never
    stops. The first such window at or after the middle that occurs nowhere earlier."""
    specials = [t.content for t in hf.get_added_tokens_decoder().values() if t.special]
    taken = set()
    for sp in specials:
        i = text.find(sp)
        while i >= 0:
            taken.update(range(i, i + len(sp)))
            i = text.find(sp, i + 1)
    for i in range(len(text) // 2, len(text) - size + 1):
        stop = text[i : i + size]
        if not taken & set(range(i, i + size)) and text.find(stop) == i:
            return stop
    raise AssertionError(f"no plain {size}-character window in the second half of {text!r}")


def test_stop_string_ends_the_answer_and_frees_the_slot(server, oai, hf):
    """A stop string (deepseek-recipe matches it in the answer text) cuts the answer before it and
    aborts the engine request at once."""
    kw = dict(model="deepseek-flash", messages=[{"role": "user", "content": "Count"}], temperature=0,
              extra_body=NO_THINKING)  # fmt: skip
    full = oai.chat.completions.create(max_tokens=40, **kw).choices[0].message.content
    text = full.rstrip("\ufffd")
    assert len(text) >= 6
    stop = _plain_stop(hf, text)
    r = oai.chat.completions.create(max_tokens=40, stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]
    server.assert_idle()


def test_ignore_eos_generates_to_max_tokens(server, oai):
    """The `ignore_eos` body extension (vLLM's) runs every request to max_tokens; a non-boolean is a
    400 naming the field."""
    kw = dict(model="deepseek-flash", messages=[{"role": "user", "content": "Hi"}], max_tokens=24)
    for seed in range(3):  # sampled: without the flag some of these may end early
        r = oai.chat.completions.create(seed=seed, extra_body={**NO_THINKING, "ignore_eos": True}, **kw)
        assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(extra_body={**NO_THINKING, "ignore_eos": "yes"}, **kw)
    assert "ignore_eos" in str(e.value)
    server.assert_idle()


def test_client_leaving_a_non_streaming_request_aborts_it(server):
    # ignore_eos: a sampled answer may end at EOS within the client's 1 s (CI saw that), which would
    # test nothing; with it the request runs 500 tokens unless aborted.
    body = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "long"}], "max_tokens": 500,
            "thinking": {"type": "disabled"}, "ignore_eos": True}  # fmt: skip
    with pytest.raises(httpx.TimeoutException):
        auth = {"authorization": f"Bearer {KEY}"}
        httpx.post(server.base + "/v1/chat/completions", json=body, headers=auth, timeout=1.0)
    server.assert_idle(timeout=3)  # sooner than 500 tokens take (checked: fails without the abort)


def test_chat_thinking_default_streams_reasoning_separately(server, oai, hf):
    seed = 1234
    kw = dict(
        model="deepseek-flash",
        messages=[{"role": "user", "content": "Is 97 prime?"}],
        max_tokens=24,
        seed=seed,
    )
    stream = oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    reasoning = content = ""
    finish = usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            finish = c.finish_reason or finish
    # Thinking is the default, effort high = 75 (spec §16.4): the prompt ends with <think>.
    effort = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    prompt = f"<｜begin▁of▁sentence｜><｜System｜>{effort}<｜User｜>Is 97 prime?<｜Assistant｜><think>"
    ids = _encode(
        hf, prompt, ["<｜begin▁of▁sentence｜>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>"]
    )
    assert usage.prompt_tokens == len(ids)
    # Thinking mode samples at temperature 1 whatever was asked; the same seed over gRPC: the same tokens.
    out = _engine_tokens(server, ids, 24, temperature=1.0, top_p=1.0, seed=seed)
    want_reasoning, want_content = _split_thinking(hf, out)
    assert reasoning == want_reasoning.lstrip("\n").rstrip("\ufffd")
    assert content == want_content.lstrip("\n").rstrip("\ufffd")
    assert finish == ("length" if len(out) == 24 else "stop")
    end = hf.token_to_id("</think>")
    assert usage.completion_tokens_details.reasoning_tokens == (out.index(end) if end in out else len(out))
    # The same request again, not streamed: the same answer, and its prompt now comes from the prefix cache.
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].message.reasoning_content == reasoning
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_cache_hit_tokens > 0
    assert r.usage.prompt_cache_hit_tokens + r.usage.prompt_cache_miss_tokens == len(ids)
    server.assert_idle()


def test_forced_tool_call_and_the_tool_result_turn(server, oai):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = oai.chat.completions.create(
        model="deepseek-flash", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=400,
        parallel_tool_calls=False,  # one call: unbounded, the random model keeps adding well-formed ones
        extra_body=NO_THINKING,
    )  # fmt: skip
    msg = r.choices[0].message
    # tool_choice required: the engine's grammar makes even the random model write a well-formed call.
    assert r.choices[0].finish_reason == "tool_calls"
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    calls = [{"id": call.id, "type": "function", "function": call.function.model_dump()}]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp": 18}'},
    ]
    r2 = oai.chat.completions.create(
        model="deepseek-flash", messages=messages, tools=[WEATHER], max_tokens=8, extra_body=NO_THINKING
    )
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    server.assert_idle()


def test_json_schema_response_validates(server, oai):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 8},
            "score": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "score"],
        "additionalProperties": False,
    }
    for thinking in (NO_THINKING, {}):  # in thinking mode the grammar starts after </think>
        r = oai.chat.completions.create(
            model="deepseek-flash", messages=[{"role": "user", "content": "Give name and score for Ada."}],
            # Strict: enforced as sent (deepseek-recipe's strict normalization would drop the lengths).
            response_format={"type": "json_schema",
                             "json_schema": {"name": "s", "schema": schema, "strict": True}},
            max_tokens=400, extra_body=thinking, seed=7, temperature=0,  # thinking mode samples at 1.0 anyway
        )  # fmt: skip
        finish = r.choices[0].finish_reason
        # The answer cannot end inside the reasoning (EOS is masked before </think>); it may run out
        # of tokens there, which finish_reason says.
        assert finish in ("stop", "length")
        if finish == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        else:
            assert thinking is not NO_THINKING
    server.assert_idle()


def test_sdk_parse_with_a_pydantic_model_that_has_length_limits(server, oai):
    """`client.chat.completions.parse(response_format=Model)` sends a strict schema: its
    minLength / maxLength / minItems / maxItems are enforced, so the parsed object validates."""
    from typing import Annotated

    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(min_length=2, max_length=6)
        tags: list[Annotated[str, pydantic.StringConstraints(max_length=4)]] = pydantic.Field(
            min_length=1, max_length=2
        )

    r = oai.chat.completions.parse(
        model="deepseek-flash", messages=[{"role": "user", "content": "A city?"}], response_format=City,
        max_tokens=400, temperature=0, extra_body=NO_THINKING,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 2 <= len(city.name) <= 6 and 1 <= len(city.tags) <= 2
    assert all(len(t) <= 4 for t in city.tags)
    server.assert_idle()


def test_required_tool_call_in_thinking_mode_reasons_then_calls(server, oai):
    """tool_choice required in the default (thinking) mode: the model reasons, then the grammar makes
    it call (the hosted API refuses this with 400). The random model closes its reasoning at some
    point; until then the answer cannot end (finish_reason is never stop without a call)."""
    for seed in range(6):
        r = oai.chat.completions.create(
            model="deepseek-flash", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=512, seed=seed,
        )  # fmt: skip
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            break
        assert choice.finish_reason == "length" and not choice.message.tool_calls, (seed, choice)
    else:
        raise AssertionError("no seed in 0..5 closed its reasoning within 512 tokens")
    assert choice.message.reasoning_content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    server.assert_idle()


def test_prefix_completion_and_fim(server, oai, hf):
    r = oai.chat.completions.create(
        model="deepseek-flash", max_tokens=8, temperature=0, extra_body=NO_THINKING,
        messages=[
            {"role": "user", "content": "Write quicksort"},
            {"role": "assistant", "content": "```python\n", "prefix": True},
        ],
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="non-thinking"):
        oai.chat.completions.create(
            model="deepseek-flash", max_tokens=8,
            messages=[
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "prefix": True}
            ],
        )  # fmt: skip
    fim = openai.OpenAI(base_url=server.base + "/beta", api_key=KEY, max_retries=0, timeout=300)
    c = fim.completions.create(
        model="deepseek-flash",
        prompt="def fib(n):\n    ",
        suffix="\n\nprint(fib(10))",
        max_tokens=10,
        temperature=0,
    )
    ids = [hf.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜fim▁begin｜>")]
    ids += PromptEncoder(hf).plain("def fib(n):\n    ") + [hf.token_to_id("<｜fim▁hole｜>")]
    ids += PromptEncoder(hf).plain("\n\nprint(fib(10))") + [hf.token_to_id("<｜fim▁end｜>")]
    assert c.usage.prompt_tokens == len(ids)
    expected = _engine_tokens(server, ids, 10)
    assert c.choices[0].text == hf.decode(expected)
    with pytest.raises(openai.BadRequestError, match="non-thinking"):
        fim.completions.create(
            model="deepseek-flash", prompt="a", max_tokens=4, extra_body={"thinking": {"type": "enabled"}}
        )
    server.assert_idle()


def test_plain_completion_with_logprobs_and_the_fim_probe(server, oai, hf):
    """`/v1/completions` without a suffix completes the text itself (BOS + prompt), with the legacy
    `logprobs` object when asked; the seeds' `fim` object on the chat route is FIM answered as chat."""
    c = oai.completions.create(
        model="deepseek-flash", prompt="The sky is", max_tokens=6, temperature=0, logprobs=2
    )
    ids = [hf.token_to_id("<｜begin▁of▁sentence｜>"), *PromptEncoder(hf).plain("The sky is")]
    assert c.usage.prompt_tokens == len(ids)
    expected = _engine_tokens(server, ids, 6)
    assert c.choices[0].text == hf.decode(expected)
    lp = c.choices[0].logprobs
    n = len(expected)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.tokens == [hf.decode([t], skip_special_tokens=False) for t in expected]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 2
        assert chosen >= max(top.values()) - 1e-5  # greedy: the chosen token is the most likely one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    probe = {
        "model": "deepseek-flash", "thinking": {"type": "disabled"}, "max_tokens": 8, "temperature": 0,
        "fim": {"prompt": "def fib(n):\n    ", "suffix": "\n\nprint(fib(10))"},
    }  # fmt: skip
    r = httpx.post(f"{server.base}/chat/completions", json=probe, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    fim_ids = [hf.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜fim▁begin｜>")]
    fim_ids += PromptEncoder(hf).plain("def fib(n):\n    ") + [hf.token_to_id("<｜fim▁hole｜>")]
    fim_ids += PromptEncoder(hf).plain("\n\nprint(fib(10))") + [hf.token_to_id("<｜fim▁end｜>")]
    out = r.json()
    assert out["object"] == "chat.completion" and out["usage"]["prompt_tokens"] == len(fim_ids)
    text = _shown(hf, _engine_tokens(server, fim_ids, 8))
    assert out["choices"][0]["message"]["content"] == text.lstrip("\n").rstrip("\ufffd")
    server.assert_idle()


def test_special_tokens_never_show_in_text(server, oai, hf):
    """A sampled answer that holds special tokens (the random model emits them) shows none of them:
    the content is the engine's tokens without them (the stream parser's markers aside)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Go"}]
    ids = httpx.post(
        f"{server.base}/tokenize", json={"messages": messages, **NO_THINKING}, headers=auth
    ).json()
    hidden = _hidden(hf)
    for seed in range(40):
        tokens = _engine_tokens(server, ids["tokens"], 48, temperature=1.0, seed=seed, ignore_eos=True)
        if hidden & set(tokens):
            break
    else:
        raise AssertionError("no seed in 0..39 samples a special token: pick another prompt")
    r = oai.chat.completions.create(
        model="deepseek-flash", messages=messages, max_tokens=48, temperature=1.0, seed=seed,
        extra_body={**NO_THINKING, "ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].message.content
    assert content == _shown(hf, tokens).lstrip("\n").rstrip("\ufffd")
    assert not [hf.id_to_token(t) for t in hidden if hf.id_to_token(t) in content]
    server.assert_idle()


def test_new_request_fields_have_their_effect(server, oai):
    """max_completion_tokens bounds the answer; top_k 1 samples the argmax at any temperature;
    stop_token_ids ends at the first such token; an unknown field is a 400 naming it."""
    kw = dict(
        model="deepseek-flash", messages=[{"role": "user", "content": "Tell me"}], extra_body=NO_THINKING
    )
    r = oai.chat.completions.create(max_completion_tokens=3, **kw, temperature=0)
    assert r.usage.completion_tokens <= 3
    greedy = oai.chat.completions.create(max_tokens=10, temperature=0, **kw).choices[0].message.content
    for seed in range(2):
        top1 = oai.chat.completions.create(
            max_tokens=10, temperature=1.5, seed=seed, model=kw["model"], messages=kw["messages"],
            extra_body={**NO_THINKING, "top_k": 1},
        )  # fmt: skip
        assert top1.choices[0].message.content == greedy
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(max_tokens=3, **{**kw, "extra_body": {**NO_THINKING, "frobnicate": 1}})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(max_tokens=3, logit_bias={"5": 10}, **kw)
    assert e.value.body["param"] == "logit_bias"
    server.assert_idle()


def test_token_counting_routes(server, oai, claude):
    """`/tokenize` counts what a chat request is served with (its usage), `/detokenize` inverts a
    plain prompt, and Anthropic's count_tokens equals the Messages request's input tokens."""
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Count me"}]
    r = oai.chat.completions.create(
        model="deepseek-flash", messages=messages, max_tokens=1, extra_body=NO_THINKING
    )
    t = httpx.post(f"{server.base}/tokenize", json={"messages": messages, **NO_THINKING}, headers=auth)
    assert t.status_code == 200 and t.json()["count"] == r.usage.prompt_tokens
    plain = httpx.post(f"{server.base}/tokenize", json={"prompt": "abc def", "add_special_tokens": False},
                       headers=auth).json()  # fmt: skip
    back = httpx.post(f"{server.base}/detokenize", json={"tokens": plain["tokens"]}, headers=auth).json()
    assert back == {"prompt": "abc def"}
    bad = httpx.post(f"{server.base}/detokenize", json={"tokens": [-1]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{server.base}/tokenize", json={"prompt": "x"}).status_code == 401
    counted = claude.messages.count_tokens(model="claude-sonnet-4", messages=messages)
    m = claude.messages.create(model="claude-sonnet-4", messages=messages, max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert not m.content or m.content[0].type == "text"  # claude-* names do not think unless asked
    server.assert_idle()


# ------------------------------------------------------------------------------------------ responses


def test_responses_api_stream_and_not(server, oai):
    r = oai.responses.create(
        model="deepseek-flash", input="Hi", max_output_tokens=10, reasoning={"effort": "low"}
    )
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens >= 1
    # Streamed: the SDK's typed events; a truncated answer ends with response.incomplete (as OpenAI's).
    events = list(
        oai.responses.create(
            model="deepseek-flash",
            input="Hi",
            max_output_tokens=10,
            reasoning={"effort": "none"},
            stream=True,
        )
    )
    types = [ev.type for ev in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    final = events[-1].response
    assert final.usage.input_tokens > 0 and final.usage.output_tokens == 10 or final.status == "completed"
    assert r.usage.input_tokens > final.usage.input_tokens  # thinking (effort low) adds the effort line
    server.assert_idle()


# ------------------------------------------------------------------------------------------ anthropic


def test_anthropic_messages_thinking_and_tools(server, claude):
    m = claude.messages.create(
        model="deepseek-flash", max_tokens=12, messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )  # fmt: skip
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    tool = {
        "name": "get_weather",
        "description": "Weather",
        "input_schema": WEATHER["function"]["parameters"],
    }
    with claude.messages.stream(
        model="claude-sonnet-4", max_tokens=12, tools=[tool],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as s:  # fmt: skip
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The tool-result turn after a tool_use block.
    m2 = claude.messages.create(
        model="deepseek-flash", max_tokens=6, tools=[tool], thinking={"type": "disabled"},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C"}]},
        ],
    )  # fmt: skip
    assert m2.usage.output_tokens >= 1
    server.assert_idle()


# --------------------------------------------------------------------------------------------- errors


def test_errors_are_the_sdks_typed_exceptions(server, oai, claude):
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        oai.chat.completions.create(model="deepseek-flash", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="json"):
        oai.chat.completions.create(
            model="deepseek-flash", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"}, extra_body=NO_THINKING,
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="image"):
        oai.chat.completions.create(
            model="deepseek-flash",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]}],
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.chat.completions.create(
            model="deepseek-flash", messages=[{"role": "user", "content": "x"}], max_tokens=CONTEXT
        )
    bad = openai.OpenAI(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="deepseek-flash", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=server.base + "/anthropic", api_key="wrong", max_retries=0
        ).messages.create(model="deepseek-flash", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="gpt-4", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="deepseek-flash", max_tokens=4, messages=[])
    server.assert_idle()


def test_effort_max_tier_full_still_admits_a_non_thinking_request(server, oai, claude):
    """The effort-max tier (limit 1, no queue here) full: another max request is a 429 RateLimitError with
    Retry-After, a non-thinking request is still served; a client that leaves frees the engine slot."""
    body = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "Prove it."}],
            "reasoning_effort": "max", "max_tokens": 400, "stream": True}  # fmt: skip
    got_first = threading.Event()
    stop = threading.Event()

    def hold():
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.stream(
            "POST", server.base + "/chat/completions", json=body, headers=headers, timeout=120
        ) as r:
            for _ in r.iter_lines():
                got_first.set()
                if stop.is_set():
                    break  # leave mid-stream: the connection closes

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert got_first.wait(120)
        with pytest.raises(openai.RateLimitError) as e:
            oai.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"})
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError):
            claude.messages.create(
                model="deepseek-flash", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                extra_body={"output_config": {"effort": "max"}},
            )  # fmt: skip
        r = oai.chat.completions.create(
            model="deepseek-flash",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body=NO_THINKING,
        )
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        stop.set()
        t.join(120)
    server.assert_idle(timeout=30)  # the abandoned stream was aborted, its slot and pages freed


def test_cost_ledger_counts_served_tokens(server, oai):
    ledger = server.server.http.ledger

    def total() -> float:
        return sum(s.value for m in ledger.tokens.collect() for s in m.samples if s.name.endswith("_total"))

    before = total()
    r = oai.chat.completions.create(
        model="deepseek-flash",
        messages=[{"role": "user", "content": "cost"}],
        max_tokens=3,
        extra_body=NO_THINKING,
    )
    assert total() - before == r.usage.prompt_tokens + r.usage.completion_tokens


def test_alias_answers_with_deprecation_header(server, oai):
    raw = oai.chat.completions.with_raw_response.create(
        model="deepseek-chat", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert raw.headers.get("deprecation")
    r = raw.parse()
    assert r.model == "deepseek-chat"
    assert not getattr(r.choices[0].message, "reasoning_content", None)  # deepseek-chat = non-thinking


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b"",
        b'"text"',
        b'{"model": 5, "messages": []}',
        b'{"model": "deepseek-flash", "messages": "hi"}',
        b'{"model": "deepseek-flash", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        b'{"model": "deepseek-flash", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        b'{"model": "deepseek-flash", "messages": [{"role": "user", "content": "x"}], "thinking": 3}',
        b'{"model": "deepseek-flash", "messages": [{"role": "wizard", "content": "x"}]}',
        b'{"model": "deepseek-flash", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        b"\xff\xfe",
    ],
)
def test_malformed_bodies_are_4xx_naming_the_problem(server, body):
    for path, anthropic_route in (("/v1/chat/completions", False), ("/anthropic/v1/messages", True),
                                  ("/v1/responses", False), ("/beta/completions", False)):  # fmt: skip
        r = httpx.post(
            server.base + path, content=body, timeout=60,
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )  # fmt: skip
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        err = r.json()
        if anthropic_route:
            assert err["type"] == "error" and err["error"]["message"]
        else:
            assert err["error"]["message"] and "Traceback" not in r.text


def test_health_models_and_unknown_route(server):
    assert httpx.get(server.base + "/health").status_code == 200
    r = httpx.get(server.base + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "deepseek-flash" in [m["id"] for m in r.json()["data"]]
    r = httpx.get(server.base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_the_seeds_probe_cases_are_served(server):
    """The deployment article's probe cases (tests/serving/seeds/probe_cases.json, copied from the seed),
    sent as written with only the base URL and key changed: each is answered 200 in shape. What they
    assert of the answer's meaning (a JSON field's value, a tool actually called) needs a trained model;
    the structure is checked instead: JSON mode's content parses when it ends by stop, FIM gives text."""
    cases = json.loads((REPO / "tests" / "serving" / "seeds" / "probe_cases.json").read_text())
    auth = {"Authorization": f"Bearer {KEY}"}
    for case in cases["probe_cases"]:
        r = httpx.post(f"{server.base}/chat/completions", json=case["request"], headers=auth, timeout=300)
        assert r.status_code == 200, (case["name"], r.text)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls"), case["name"]
        if case["name"] == "json_output" and choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        if case["name"] == "fim_non_thinking":
            assert isinstance(choice["message"]["content"], str)
    server.assert_idle()
