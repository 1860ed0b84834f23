"""Every request field of the HTTP API is implemented, a documented no-op, or refused naming it
(serving/http/fields.py), checked field by field against the hosted API's tables of
`../shared/spec/api-surface.md` (copied to tests/serving/hosted_api_fields.md); the fields issue 36
added (max_completion_tokens, top_k, stop_token_ids, seed), plain completions beside FIM, the seeds'
`fim` probe, Anthropic's thinking default for claude-* names, token counting, structured output.
Converter level: no engine, no model."""

from __future__ import annotations

import json
import re

import pytest
from serving_helpers import http_converter

from serving.http import tokenize as counting
from serving.http.convert import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from serving.http.errors import ApiError
from serving.http.fields import TABLES, Handling, markdown
from tests.conftest import GOLDEN_TINY_V, REPO

SPEC = REPO / "tests" / "serving" / "hosted_api_fields.md"  # api-surface.md's tables, copied
LIMIT = 1024
BODIES = {
    CHAT: {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}]},
    RESPONSES: {"model": "deepseek-flash", "input": "hi"},
    MESSAGES: {"model": "deepseek-flash", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"model": "deepseek-flash", "prompt": "def f(", "suffix": "):"},
}
# A valid value for each field the server accepts and ignores.
NO_OP_VALUES = {
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "metadata": {"k": "v"}, "store": False,
    "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1", "verbosity": "low",
    "include": [], "truncation": "disabled", "stream_options": {"include_obfuscation": False},
}  # fmt: skip
REFUSED_VALUES = {
    "logit_bias": {"15": 3}, "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "best_of": 2, "previous_response_id": "resp_1", "conversation": "conv_1",
    "background": True, "prompt": {"id": "pmpt_1"}, "container": "c", "mcp_servers": [{"url": "x"}],
    "context_management": {"edits": []},
}  # fmt: skip


@pytest.fixture(scope="module")
def converter():
    return http_converter(GOLDEN_TINY_V / "tokenizer.json", max_tokens_limit=LIMIT)


def prepare(converter, api, body):
    return converter.prepare(api, json.dumps(body).encode())


def refused(converter, api, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        prepare(converter, api, body)
    assert e.value.status == 400
    return e.value


def _spec_fields(heading: str) -> set[str]:
    """The top-level field names in the first column of the table under `heading` in api-surface.md."""
    text = SPEC.read_text()
    section = text[text.index(heading) :]
    rows = [line for line in section.split("\n#")[0].splitlines() if line.startswith("| `")]
    names = set()
    for row in rows:
        first = row.split("|")[1]
        if "role" in first or "header" in first:
            continue
        for name in re.findall(r"`([a-z_]+)(?:[.\[][^`]*)?`", first):
            names.add(name)
    return names


@pytest.mark.parametrize(
    "api, heading",
    [
        (CHAT, "### 3.1 Fields"),
        (COMPLETIONS, "## 10. FIM completion"),
        (RESPONSES, "### 11.1 Request fields"),
        (MESSAGES, "### 12.1 Field support"),
    ],
)
def test_every_hosted_field_is_in_the_table(api, heading):
    spec = _spec_fields(heading)
    assert len(spec) >= 8  # the parse found the table
    ours = {f.name: f.handling for f in TABLES[api]}
    missing = sorted(spec - set(ours))
    assert not missing, f"{api}: fields of the hosted API with no handling: {missing}"
    # What the hosted API supports is not refused here (previous_response_id: the hosted API drops it
    # silently, which is what this server must not do; the Anthropic server tools likewise).
    refused_ok = {"previous_response_id", "container", "mcp_servers"}
    assert not [n for n in spec if ours[n] is Handling.REFUSED and n not in refused_ok]


@pytest.mark.parametrize("api", list(TABLES))
def test_each_field_is_honoured_ignored_or_refused(converter, api):
    body = BODIES[api]
    for f in TABLES[api]:
        if f.handling is Handling.NO_OP:
            prepare(converter, api, {**body, f.name: NO_OP_VALUES[f.name]})
        elif f.handling is Handling.REFUSED:
            err = refused(converter, api, {**body, f.name: REFUSED_VALUES[f.name]})
            assert err.param == f.name and err.message.startswith(f"{f.name}: not supported")
            for value in f.allowed:  # the value that asks for nothing is accepted
                prepare(converter, api, {**body, f.name: value})
    err = refused(converter, api, {**body, "frobnicate": 1})
    assert err.param == "frobnicate" and "unknown field" in err.message


def test_penalties_are_range_checked_on_every_route(converter):
    for api in (CHAT, COMPLETIONS):
        err = refused(converter, api, {**BODIES[api], "presence_penalty": 3})
        assert "presence_penalty" in err.message


def test_max_completion_tokens(converter):
    body = {**BODIES[CHAT], "thinking": {"type": "disabled"}}
    assert prepare(converter, CHAT, {**body, "max_completion_tokens": 3}).max_tokens == 3
    assert prepare(converter, CHAT, {**body, "max_tokens": 5, "max_completion_tokens": 9}).max_tokens == 5
    assert prepare(converter, CHAT, {**body, "max_tokens": 9, "max_completion_tokens": 5}).max_tokens == 5
    err = refused(converter, CHAT, {**body, "max_completion_tokens": 0})
    assert err.param == "max_completion_tokens"
    err = refused(converter, CHAT, {**body, "max_completion_tokens": "3"})
    assert err.param == "max_completion_tokens"


@pytest.mark.parametrize("api", list(TABLES))
def test_sampling_extensions(converter, api):
    body = BODIES[api]
    p = prepare(converter, api, {**body, "top_k": 7, "stop_token_ids": [1, 2], "seed": 2**40 + 9})
    assert p.sampling.top_k == 7 and p.stop_token_ids == (1, 2) and p.sampling.seed == 9
    assert prepare(converter, api, body).sampling.top_k == 0
    assert refused(converter, api, {**body, "top_k": -1}).param == "top_k"
    assert refused(converter, api, {**body, "stop_token_ids": ["a"]}).param == "stop_token_ids"


def test_plain_completion_without_suffix(converter):
    body = {"model": "deepseek-flash", "prompt": "The sky is"}
    p = prepare(converter, COMPLETIONS, body)
    assert p.prompt_ids == (converter.bos_id, *converter.encoder.plain("The sky is"))
    assert p.max_tokens == 16  # OpenAI's (and vLLM's) default for a plain completion
    # Beyond the FIM limit of 4096: a plain completion takes the chat range (here, the server's limit).
    assert prepare(converter, COMPLETIONS, {**body, "max_tokens": 1000}).max_tokens == 1000
    fim = prepare(converter, COMPLETIONS, {**body, "suffix": "blue."})
    assert fim.prompt_ids[:2] == (converter.bos_id, converter._fim[0])
    assert fim.prompt_ids[-1] == converter._fim[2]
    assert refused(converter, COMPLETIONS, {**body, "suffix": "x", "max_tokens": 5000}).param == "max_tokens"
    err = refused(converter, COMPLETIONS, {**body, "echo": True, "logprobs": 2})
    assert err.param == "echo"


def test_the_seeds_fim_probe_on_the_chat_route(converter):
    fim = {"prompt": "def fib(n):\n    ", "suffix": "\n\nprint(fib(10))"}
    body = {"model": "deepseek-flash", "thinking": {"type": "disabled"}, "fim": fim, "max_tokens": 64}
    p = prepare(converter, CHAT, body)
    plain = converter.encoder.plain
    b, begin, hole, end = converter.bos_id, *converter._fim
    assert p.api == CHAT and p.conv is not None and p.max_tokens == 64
    assert p.prompt_ids == (b, begin, *plain(fim["prompt"]), hole, *plain(fim["suffix"]), end)
    no_thinking = {k: v for k, v in body.items() if k != "thinking"}
    assert refused(converter, CHAT, no_thinking).param == "thinking"
    prepare(converter, CHAT, {**no_thinking, "reasoning_effort": "none"})
    assert refused(converter, CHAT, {**body, "messages": [{"role": "user", "content": "x"}]}).param == "fim"
    assert (
        refused(converter, CHAT, {**body, "response_format": {"type": "json_object"}}).param
        == "response_format"
    )
    assert refused(converter, CHAT, {**body, "fim": {"prompt": "x", "middle": "y"}}).param == "fim"
    assert refused(converter, CHAT, {**body, "fim": "x"}).param == "fim"


def test_claude_names_think_only_when_asked(converter):
    msg = BODIES[MESSAGES]
    assert not prepare(converter, MESSAGES, {**msg, "model": "claude-sonnet-4-5"}).thinking
    asked = {**msg, "model": "claude-sonnet-4-5", "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert prepare(converter, MESSAGES, asked).thinking
    assert prepare(converter, MESSAGES, msg).thinking  # the served name keeps DeepSeek's default


def test_token_counting(converter):
    chat = prepare(converter, CHAT, BODIES[CHAT])
    out = counting.tokenize(converter, {"messages": BODIES[CHAT]["messages"], "return_token_strs": True}, "")
    assert out["tokens"] == list(chat.prompt_ids) and out["count"] == len(chat.prompt_ids)
    assert "".join(out["token_strs"]) == converter.decode(chat.prompt_ids)
    text = counting.tokenize(converter, {"prompt": "hello world"}, "")
    assert text["tokens"] == [converter.bos_id, *converter.encoder.plain("hello world")]
    bare = counting.tokenize(converter, {"prompt": "hello world", "add_special_tokens": False}, "")
    assert bare["tokens"] == text["tokens"][1:] and text["max_model_len"] == 4096
    assert counting.detokenize(converter, {"tokens": bare["tokens"]}) == {"prompt": "hello world"}
    msg = {k: v for k, v in BODIES[MESSAGES].items() if k != "max_tokens"}
    n = counting.count_tokens(converter, msg, "")["input_tokens"]
    assert n == len(prepare(converter, MESSAGES, BODIES[MESSAGES]).prompt_ids)
    for job, body, param in (
        (lambda b: counting.tokenize(converter, b, ""), {"prompt": "x", "messages": []}, "prompt"),
        (lambda b: counting.tokenize(converter, b, ""), {"prompt": "x", "extra": 1}, "extra"),
        (lambda b: counting.detokenize(converter, b), {"tokens": [10**9]}, "tokens"),
        (lambda b: counting.detokenize(converter, b), {"tokens": "abc"}, "tokens"),
    ):
        with pytest.raises(ApiError) as e:
            job(body)
        assert e.value.status == 400 and e.value.param == param


def test_the_docs_table_is_generated_from_the_code():
    assert (REPO / "docs" / "api-fields.md").read_text() == markdown()


# ---- structured output (issue 36.3) -----------------------------------------------------------------
def _tool(name: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [_tool("f", {"a": {"type": "string"}}), _tool("g", {})]


def test_forced_tool_choice_in_thinking_mode_reasons_then_calls(converter):
    body = {**BODIES[CHAT], "tools": TOOLS}
    required = prepare(converter, CHAT, {**body, "tool_choice": "required"})
    assert required.thinking and required.constraint.kind == "tool_calls"
    assert [t["function"]["name"] for t in required.constraint.tools] == ["f", "g"]
    assert required.constraint.start_after_token == converter.think_end_id
    named = prepare(converter, CHAT, {**body, "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert [t["function"]["name"] for t in named.constraint.tools] == ["g"]
    err = refused(converter, CHAT, {**body, "tool_choice": {"type": "function", "function": {"name": "h"}}})
    assert err.param == "tool_choice" and "'h'" in err.message
    responses = {**BODIES[RESPONSES], "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
    p = prepare(converter, RESPONSES, {**responses, "tool_choice": {"type": "function", "name": "f"}})
    assert p.thinking and [t["function"]["name"] for t in p.constraint.tools] == ["f"]
    # Non-thinking: deepseek-recipe's own constraint, from the first token.
    off = prepare(converter, CHAT, {**body, "tool_choice": "required", "thinking": {"type": "disabled"}})
    assert off.constraint.kind == "tool_calls" and off.constraint.start_after_token is None


def test_anthropic_tool_choice_any_and_tool_are_enforced(converter):
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    body = {**BODIES[MESSAGES], "model": "claude-sonnet-4", "tools": tools}
    any_ = prepare(converter, MESSAGES, {**body, "tool_choice": {"type": "any"}})
    assert not any_.thinking and any_.constraint.kind == "tool_calls"
    assert prepare(converter, MESSAGES, {**body, "tool_choice": {"type": "auto"}}).constraint is None
    thinking = {"type": "enabled", "budget_tokens": 1024}
    named = prepare(
        converter, MESSAGES, {**body, "thinking": thinking, "tool_choice": {"type": "tool", "name": "f"}}
    )
    assert named.thinking and named.constraint.kind == "tool_calls"
    assert named.constraint.start_after_token == converter.think_end_id


def test_a_strict_schema_is_enforced_as_sent(converter):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    assert prepare(converter, CHAT, {**BODIES[CHAT], "response_format": fmt}).constraint.json_schema == schema
    text = {"format": {"type": "json_schema", "name": "p", "schema": schema, "strict": True}}
    assert prepare(converter, RESPONSES, {**BODIES[RESPONSES], "text": text}).constraint.json_schema == schema
    # A keyword the grammar library cannot enforce is a 400 naming it, never dropped.
    unique = {
        "type": "object",
        "properties": {"t": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    fmt["json_schema"]["schema"] = unique
    err = refused(converter, CHAT, {**BODIES[CHAT], "response_format": fmt})
    assert err.param == "response_format" and "uniqueItems" in err.message


def test_a_messages_answer_cut_inside_a_tool_call_drops_the_call():
    from serving.http.stream import without_cut_tool_use

    cut = {
        "stop_reason": "max_tokens",
        "content": [{"type": "text", "text": "x"}, {"type": "tool_use", "input": {}}],
    }
    assert without_cut_tool_use(MESSAGES, dict(cut))["content"] == [{"type": "text", "text": "x"}]
    done = {**cut, "stop_reason": "tool_use"}
    assert without_cut_tool_use(MESSAGES, dict(done))["content"] == cut["content"]


@pytest.mark.parametrize("api", [CHAT, MESSAGES])
def test_tool_choice_none_cannot_call(converter, api):
    """tool_choice none with tools declared: the answer is text, and the grammar never allows the
    tool-call marker (nor any other special token but EOS)."""
    import numpy as np

    from serving.constraints import DSML_TOKEN, ConstraintTokenizer

    if api == CHAT:
        body = {**BODIES[CHAT], "tools": TOOLS, "tool_choice": "none"}
    else:
        tools = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
        body = {**BODIES[MESSAGES], "tools": tools, "tool_choice": {"type": "none"}}
    p = prepare(converter, api, body)
    assert p.constraint.kind == "regex" and p.constraint.start_after_token == converter.think_end_id
    hf = converter._hf
    eos = hf.token_to_id("<｜end▁of▁sentence｜>")
    ctok = ConstraintTokenizer(
        GOLDEN_TINY_V / "tokenizer.json", vocab_size=hf.get_vocab_size(), eos_token_ids=(eos,)
    )
    matcher = ctok.matcher(p.constraint)
    matcher.consume(converter.think_end_id)  # the reasoning ends; the answer starts
    row = np.zeros(ctok.words, np.int32)
    matcher.fill(row)
    allowed = set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())
    assert hf.token_to_id(DSML_TOKEN) not in allowed and eos in allowed and len(allowed) > 100
    assert prepare(converter, api, {k: v for k, v in body.items() if k != "tool_choice"}).constraint is None
