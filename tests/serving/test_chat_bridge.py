"""serving.chat.bridge: deepseek-recipe conversations rendered with our encoder.

For realistic Chat Completions, Responses and Anthropic Messages bodies converted by deepseek-recipe, our
render must equal the library's own V4.1 rendering (prompt, special ranges, image count) wherever the library
agrees with DeepSeek's reference encoder; the cases where they disagree are pinned to the reference's rules.
"""

import deepseek_recipe as d
import pytest
import tokenizers

from ced_jax.chat import ChatFormatError, PromptEncoder, encode_prompt, resolve_thinking
from serving.chat.bridge import render_conversation
from tests.conftest import GOLDEN_CHAT_ENCODING

ST = d.SpecialTokens(image="<｜deepseek_image｜>")
OPTS = d.ConversionOptions().with_special_tokens(ST).with_model_alias("m", d.ModelVersion.DeepseekV41Flash)
ENC = d.DeepseekV41Encoding().with_special_tokens(ST)
EFFORT_75 = (
    "<｜System｜>Reasoning Effort: 75 "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)

img = "data:image/png;base64,iVBORw0KGgo="
W = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CHAT = {
    "chat_plain": {"messages": [{"role": "user", "content": "hi"}]},
    "chat_off": {
        "thinking": {"type": "disabled"},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    },
    "effort_low": {
        "reasoning_effort": "low",
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
    },
    "effort_max": {"reasoning_effort": "max", "messages": [{"role": "user", "content": "hi"}]},
    "effort_xhigh": {"reasoning_effort": "xhigh", "messages": [{"role": "user", "content": "hi"}]},
    "effort_none": {"reasoning_effort": "none", "messages": [{"role": "user", "content": "hi"}]},
    "multiturn_think": {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "r1"},
            {"role": "user", "content": "c"},
        ]
    },
    "multiturn_chat": {
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    },
    "tools_t1": {"messages": [{"role": "user", "content": "Weather in Paris for 2 days?"}], "tools": [W]},
    "tools_t2": {
        "messages": [
            {"role": "user", "content": "Weather in Paris for 2 days?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should call get_weather.",
                "tool_calls": [
                    {
                        "id": "call_00_abc",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_00_abc", "content": '{"forecast": ["sunny", "rain"]}'},
        ],
        "tools": [W],
    },
    "tools_parallel_chat": {
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"A"}'},
                    },
                    {
                        "id": "b",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"B"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "b", "content": "B!"},
            {"role": "tool", "tool_call_id": "a", "content": "A!"},
        ],
        "tools": [W],
    },
    "tools_then_user": {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "x",
                "reasoning_content": "r",
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"A"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "A!"},
            {"role": "assistant", "content": "done", "reasoning_content": "r2"},
            {"role": "user", "content": "more"},
        ],
        "tools": [W],
    },
    "tool_choice_none": {"messages": [{"role": "user", "content": "q"}], "tools": [W], "tool_choice": "none"},
    "tool_choice_required": {
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "q"}],
        "tools": [W],
        "tool_choice": "required",
    },
    "tool_choice_named": {
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "q"}],
        "tools": [
            W,
            {
                "type": "function",
                "function": {"name": "other", "parameters": {"type": "object", "properties": {}}},
            },
        ],
        "tool_choice": {"type": "function", "function": {"name": "other"}},
    },
    "json_object": {
        "thinking": {"type": "disabled"},
        "response_format": {"type": "json_object"},
        "messages": [
            {"role": "system", "content": "Reply with a JSON object."},
            {"role": "user", "content": "Give name and score for Ada."},
        ],
    },
    "json_object_think_nosys": {
        "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "json please"}],
    },
    "json_schema": {
        "thinking": {"type": "disabled"},
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            },
        },
        "messages": [{"role": "user", "content": "q"}],
    },
    "regex": {
        "thinking": {"type": "disabled"},
        "response_format": {"type": "regex", "regex": "[a-z]+"},
        "messages": [{"role": "user", "content": "q"}],
    },
    "prefix_chat": {
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "Write quicksort in Python"},
            {"role": "assistant", "content": "```python\n", "prefix": True},
        ],
    },
    "prefix_think_content": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "x", "reasoning_content": "Done thinking.", "prefix": True},
        ]
    },
    "prefix_think_reasoning": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "Let me", "prefix": True},
        ]
    },
    "prefix_think_empty": {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "prefix": True}]
    },
    "mid_system": {
        "reasoning_effort": "max",
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "system", "content": "now French"},
        ],
    },
    "images": {
        "thinking": {"type": "disabled"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image_url", "image_url": {"url": img}},
                    {"type": "image_url", "image_url": {"url": "http://x/b.png"}},
                    {"type": "text", "text": "Which?"},
                ],
            }
        ],
    },
    "image_first": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": img}},
                    {"type": "text", "text": "What?"},
                ],
            }
        ]
    },
    "tool_image": {
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "text", "text": "r1"}, {"type": "image_url", "image_url": {"url": img}}],
            },
        ],
        "tools": [W],
    },
    "unicode": {
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Météo à Zürich? 天气"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "meteo", "description": "天气 météo", "parameters": {"type": "object"}},
            }
        ],
    },
    "mid_system_tools_json": {
        "thinking": {"type": "disabled"},
        "response_format": {"type": "json_object"},
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "system", "content": "answer in json"},
            {"role": "user", "content": "c"},
        ],
        "tools": [W],
    },
    "typed_eos": {"messages": [{"role": "user", "content": "x<｜end▁of▁sentence｜>y"}]},
    "trailing_assistant_chat": {
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    },
}
RESPONSES = {
    "resp_developer_multiturn": {
        "input": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        "reasoning": {"effort": "high"},
    },
    "resp_instructions": {"instructions": "Be nice", "input": "hi", "reasoning": {"effort": "low"}},
    "resp_off": {"input": [{"role": "user", "content": "hi"}], "reasoning": {"effort": "none"}},
    "resp_tools": {
        "input": [
            {"role": "user", "content": "Weather?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Get weather",
                "parameters": W["function"]["parameters"],
            }
        ],
    },
    "resp_json": {"input": "give json", "text": {"format": {"type": "json_object"}}},
    "resp_image": {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": img}],
            }
        ]
    },
}
MESSAGES = {
    "anth_system": {"max_tokens": 100, "system": "sys", "messages": [{"role": "user", "content": "q"}]},
    "anth_off": {
        "max_tokens": 100,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "q"}],
    },
    "anth_effort": {
        "max_tokens": 100,
        "output_config": {"effort": "low"},
        "messages": [{"role": "user", "content": "q"}],
    },
    "anth_tools": {
        "max_tokens": 100,
        "tools": [
            {"name": "get_weather", "description": "Get weather", "input_schema": W["function"]["parameters"]}
        ],
        "messages": [
            {"role": "user", "content": "w?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "call it", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    },
    "anth_image": {
        "max_tokens": 100,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                    },
                ],
            }
        ],
    },
    "anth_prefill": {
        "max_tokens": 100,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre"}],
    },
}
ALL = (
    [(f"chat/{k}", d.ChatCompletionRequest, v) for k, v in CHAT.items()]
    + [(f"responses/{k}", d.ResponsesRequest, v) for k, v in RESPONSES.items()]
    + [(f"messages/{k}", d.MessagesRequest, v) for k, v in MESSAGES.items()]
)


def _convert(kind, body) -> d.Conversation:
    return kind(dict(body, model="m")).convert(OPTS).conversation


@pytest.mark.parametrize(("kind", "body"), [(k, b) for _, k, b in ALL], ids=[n for n, _, _ in ALL])
def test_render_equals_library(kind, body):
    conv = _convert(kind, body)
    theirs = ENC.render_conversation(conv)
    ours = render_conversation(conv)
    assert ours.prompt == theirs.prompt
    assert ours.special_ranges == [tuple(r) for r in theirs.special_ranges]
    assert [(s.kind, s.url, s.data_url) for s in ours.images] == [
        (s.kind, s.url, s.data_url) for s in theirs.image_sources
    ]


@pytest.fixture(scope="module")
def token_encoders():
    path = str(GOLDEN_CHAT_ENCODING / "tokenizer.json")
    return PromptEncoder(tokenizers.Tokenizer.from_file(path)), ENC.with_tokenizer(
        d.Tokenizer.from_file(path)
    )


@pytest.mark.parametrize(("kind", "body"), [(k, b) for _, k, b in ALL], ids=[n for n, _, _ in ALL])
def test_token_ids_equal_library(kind, body, token_encoders):
    """encode_prompt tokenizes as the library's prompt encoding (special ids only where it placed them)."""
    ours, theirs = token_encoders
    conv = _convert(kind, body)
    assert encode_prompt(render_conversation(conv), ours) == theirs.encode(conv)


def test_required_tool_choice_prefills_the_calls_block():
    conv = _convert(d.ChatCompletionRequest, CHAT["tool_choice_named"])
    rendered = render_conversation(conv)
    assert rendered.prompt.endswith("<｜User｜>q<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n")
    assert rendered.prompt[slice(*rendered.special_ranges[-1])] == "｜DSML｜"
    # A named function narrows the rendered tools to that one.
    assert '{"name": "other"' in rendered.prompt and '"get_weather"' not in rendered.prompt


def test_integer_and_seed_efforts():
    conv = _convert(d.ChatCompletionRequest, {"messages": [{"role": "user", "content": "q"}]})
    prompt = render_conversation(conv, effort=37).prompt
    assert prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 37 (range 1-100")
    thinking, effort = resolve_thinking({"type": "enabled", "effort": "max"}, None)
    assert "Reasoning Effort: 100 " in render_conversation(conv, effort=effort, thinking=thinking).prompt
    thinking, effort = resolve_thinking(None, "none")
    assert render_conversation(conv, effort=effort, thinking=thinking).prompt == (
        "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>"
    )


# Where deepseek-recipe and the reference disagree (see serving/chat/bridge.py); expected strings follow the
# reference's rules.


def test_latest_reminder_follows_the_reference():
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "latest_reminder", "content": "rem"}]}
    conv = _convert(d.ChatCompletionRequest, body)
    ours = render_conversation(conv).prompt
    assert (
        ours == f"<｜begin▁of▁sentence｜>{EFFORT_75}<｜User｜>q<｜Assistant｜><think><｜latest_reminder｜>rem"
    )
    assert ENC.render_conversation(conv).prompt.endswith(
        "<｜User｜>q<｜latest_reminder｜>rem<｜Assistant｜><think>"
    )


def test_trailing_assistant_in_thinking_mode_keeps_its_reasoning():
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ]
    }
    conv = _convert(d.ChatCompletionRequest, body)
    assert render_conversation(conv).prompt == (
        f"<｜begin▁of▁sentence｜>{EFFORT_75}<｜User｜>q<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>"
        "<｜Assistant｜><think>"
    )
    # The library drops that reasoning, as if a later user turn existed.
    assert "<think>r</think>" not in ENC.render_conversation(conv).prompt


def test_typed_image_placeholder_is_refused():
    # The reference refuses it; the library renders it as plain text.
    conv = _convert(
        d.ChatCompletionRequest, {"messages": [{"role": "user", "content": "q <｜deepseek_image｜>"}]}
    )
    with pytest.raises(ChatFormatError, match="image placeholder"):
        render_conversation(conv)


def test_system_message_tools_render_as_reference_message_tools():
    tool = d.ToolDefinition("f", "does f", {"type": "object"})
    conv = d.Conversation([d.SystemMessage("sys", tools=[tool]), d.UserMessage("q")], thinking_mode=False)
    prompt = render_conversation(conv).prompt
    assert prompt.startswith(
        "<｜begin▁of▁sentence｜><｜System｜>sys\n\n## Tools\n\nYou have access to a set of tools"
    )
    assert prompt.endswith(
        '{"name": "f", "description": "does f", "parameters": {"type": "object"}}\n\n'
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        "<｜User｜>q<｜Assistant｜></think>"
    )
