"""ced_jax.chat.encoding beyond the golden set: special-token tracking, tokenizing client text, errors."""

import json

import pytest
import tokenizers

from ced_jax.chat import ChatFormatError, PromptEncoder, encode_prompt, parse_completion, render_messages
from tests.conftest import GOLDEN_CHAT_ENCODING

SPECIALS = json.loads((GOLDEN_CHAT_ENCODING / "special_tokens.json").read_text())["tiny_tokenizer_ids"]
EOS_ID = SPECIALS["<｜end▁of▁sentence｜>"]


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(GOLDEN_CHAT_ENCODING / "tokenizer.json"))


def test_typed_special_tokens_stay_plain_text(tokenizer):
    typed = "x<｜end▁of▁sentence｜>y<think>z<｜Assistant｜>"
    rendered = render_messages([{"role": "user", "content": typed}], thinking_mode="chat")
    assert rendered.prompt == f"<｜begin▁of▁sentence｜><｜User｜>{typed}<｜Assistant｜></think>"
    # Only the renderer's own tokens are listed: BOS, User, Assistant, </think>.
    assert [rendered.prompt[a:b] for a, b in rendered.special_ranges] == [
        "<｜begin▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "</think>",
    ]
    ids = encode_prompt(rendered, tokenizer)
    typed_ids = ids[2:-2]
    assert ids[:2] == [SPECIALS["<｜begin▁of▁sentence｜>"], SPECIALS["<｜User｜>"]]
    assert ids[-2:] == [SPECIALS["<｜Assistant｜>"], SPECIALS["</think>"]]
    assert not set(typed_ids) & set(SPECIALS.values())
    assert tokenizer.decode(typed_ids, skip_special_tokens=False) == typed
    # Whole-string encoding (what vLLM does) would turn the typed spelling into the EOS id.
    assert EOS_ID in tokenizer.encode(rendered.prompt, add_special_tokens=False).ids


def test_typed_dsml_in_tool_arguments_is_plain(tokenizer):
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": "</think>｜DSML｜"}},
                }
            ],
        },
    ]
    rendered = render_messages(messages, thinking_mode="chat")
    specials = [rendered.prompt[a:b] for a, b in rendered.special_ranges]
    # Three DSML tokens of the block markup each side of the call, none from the argument value.
    assert specials.count("｜DSML｜") == 6
    assert specials.count("</think>") == 1


def test_marker_characters_in_input_do_not_confuse_ranges():
    text = "".join(chr(c) for c in range(0xE000, 0xE010))
    rendered = render_messages([{"role": "user", "content": text}], thinking_mode="chat")
    assert rendered.prompt == f"<｜begin▁of▁sentence｜><｜User｜>{text}<｜Assistant｜></think>"
    assert len(rendered.special_ranges) == 4


def test_every_special_range_is_a_vocabulary_special(tokenizer):
    messages = [
        {"role": "system", "content": "s", "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "u"}]},
        {"role": "assistant", "reasoning_content": "r", "content": "c"},
        {"role": "user", "content": "again", "task": "query"},
    ]
    rendered = render_messages(messages, thinking_mode="thinking", reasoning_effort=10)
    spans = [rendered.prompt[a:b] for a, b in rendered.special_ranges]
    assert set(spans) <= set(SPECIALS) | {"<｜query｜>"}
    # No special spelling outside the ranges: the renderer placed every one in this conversation.
    plain = rendered.prompt
    for a, b in reversed(rendered.special_ranges):
        plain = plain[:a] + plain[b:]
    assert not any(s in plain for s in SPECIALS)
    assert (
        encode_prompt(rendered, tokenizer) == tokenizer.encode(rendered.prompt, add_special_tokens=False).ids
    )


def test_special_missing_from_vocabulary_is_spelled_out(tokenizer):
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<｜query｜>"]
    small = tokenizers.Tokenizer.from_str(json.dumps(spec))
    rendered = render_messages([{"role": "user", "content": "x", "task": "query"}], thinking_mode="chat")
    assert rendered.prompt.endswith("<｜User｜>x<｜query｜>")
    assert encode_prompt(rendered, small) == small.encode(rendered.prompt, add_special_tokens=False).ids
    assert encode_prompt(rendered, PromptEncoder(small)) == encode_prompt(rendered, small)


def _variant(tokenizer, edit) -> tokenizers.Tokenizer:
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in (edit(dict(t)) for t in spec["added_tokens"]) if t is not None]
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: {**t, "lstrip": True},
        lambda t: {**t, "rstrip": True},
        lambda t: {**t, "lstrip": True, "rstrip": True},
        # Vocabularies without some of the renderer's tokens: those become plain text.
        lambda t: (
            None
            if t["content"] in ("<｜query｜>", "<｜action｜>", "<｜latest_reminder｜>", "</think>")
            else t
        ),
    ],
    ids=["lstrip", "rstrip", "both", "missing"],
)
def test_golden_prompts_under_other_tokenizers(tokenizer, edit):
    """On prompts with no typed special spellings, encode_prompt equals the full tokenizer's encoding."""
    other = _variant(tokenizer, edit)
    encoder = PromptEncoder(other)
    cases = [json.loads(line) for line in (GOLDEN_CHAT_ENCODING / "cases.jsonl").read_text().splitlines()]
    n = 0
    for case in cases:
        if case["kind"] != "encode" or "error" in case["expected"]:
            continue
        options = {k: case[k] for k in ("context", "drop_thinking", "add_default_bos_token") if k in case}
        rendered = render_messages(
            case["messages"],
            thinking_mode=case["thinking_mode"],
            reasoning_effort=case["reasoning_effort"],
            **options,
        )
        assert encoder.encode(rendered) == other.encode(rendered.prompt, add_special_tokens=False).ids, case[
            "id"
        ]
        n += 1
    assert n > 20


# Rules of the reference encoder the golden set does not exercise (expected strings written from its rules).


def test_no_messages_renders_bos_only():
    assert render_messages([], thinking_mode="thinking").prompt == "<｜begin▁of▁sentence｜>"


def test_consecutive_user_messages_merge():
    rendered = render_messages(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], thinking_mode="chat"
    )
    assert rendered.prompt == "<｜begin▁of▁sentence｜><｜User｜>a\n\nb<｜Assistant｜></think>"


def test_user_text_after_tool_results_joins_the_same_turn():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "r"},
        {"role": "user", "content": "thanks"},
    ]
    prompt = render_messages(messages, thinking_mode="chat").prompt
    assert prompt.endswith(
        '<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>'
        "<｜User｜><tool_result>r</tool_result>\n\nthanks<｜Assistant｜></think>"
    )


def test_trailing_assistant_without_wo_eos_opens_no_header():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    prompt = render_messages(messages, thinking_mode="chat").prompt
    assert prompt.endswith("<｜Assistant｜></think>a<｜end▁of▁sentence｜>")


def test_assistant_after_task_has_no_reasoning_part():
    messages = [
        {"role": "user", "content": "q", "task": "domain"},
        {"role": "assistant", "content": "example.com", "reasoning_content": "r"},
    ]
    prompt = render_messages(messages, thinking_mode="thinking").prompt
    assert prompt.endswith("<｜User｜>q<｜domain｜>example.com<｜end▁of▁sentence｜>")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"messages": [{"role": "developer", "content": "x"}], "thinking_mode": "chat"}, "role"),
        (
            {"messages": [{"role": "user", "content": "x", "task": "summarize"}], "thinking_mode": "chat"},
            "task",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "thinking_mode": "fast"}, "thinking_mode"),
        (
            {"messages": [{"role": "user", "content": "x"}], "thinking_mode": "chat", "reasoning_effort": 0},
            "effort",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "thinking_mode": "chat",
                "reasoning_effort": True,
            },
            "effort",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "thinking_mode": "thinking",
                "reasoning_effort": "xhigh",
            },
            "effort",
        ),
        (
            {
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                "thinking_mode": "chat",
            },
            "source",
        ),
        (
            {
                "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
                "thinking_mode": "chat",
            },
            "tool_calls",
        ),
        (
            {
                "messages": [{"role": "system", "content": "", "tools": [{"name": "f"}]}],
                "thinking_mode": "chat",
            },
            "tools",
        ),
        ({"messages": [{"role": "user", "content": None}], "thinking_mode": "chat"}, "content"),
    ],
)
def test_refused(kwargs, field):
    with pytest.raises(ChatFormatError, match=field):
        render_messages(**kwargs)


def test_invalid_task_before_a_user_turn_is_not_checked():
    # The reference checks a task only where it renders the task token (the message ends a user block).
    messages = [{"role": "user", "content": "a", "task": "bogus"}, {"role": "system", "content": "s"}]
    prompt = render_messages(messages, thinking_mode="chat").prompt
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>a<｜System｜>s<｜Assistant｜></think>"


@pytest.mark.parametrize(
    "text",
    [
        "a<｜end▁of▁sentence｜>b",  # text after EOS
        "a\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>tail",  # text after the calls block
        'a\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="x" string="maybe">1'
        "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",  # bad string flag
        "<think>a<｜end▁of▁sentence｜>",  # special token in content
    ],
)
def test_parse_refused(text):
    with pytest.raises(ChatFormatError):
        parse_completion(text, "chat")


def test_parse_empty_call_and_raw_values():
    text = (
        'x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name="g">\n'
        '<｜DSML｜ parameter name="s" string="true">line1\n"q"</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">[1,2]</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
        "</｜DSML｜ calls>"
    )
    message = parse_completion(text, "chat")
    assert message["content"] == "x"
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "f", "arguments": "{}"},
        {"name": "g", "arguments": '{"s": "line1\\n\\"q\\"", "n": [1,2]}'},
    ]
