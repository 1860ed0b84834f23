"""A deepseek-recipe `Conversation` rendered with our reference-exact encoder.

The HTTP layer converts Chat Completions / Responses / Anthropic Messages bodies with deepseek-recipe
(`ChatCompletionRequest(body).convert(opts)` etc.), which validates the request and yields a
`Conversation` plus inference and parsing options. `render_conversation` maps that conversation onto the
reference encoder's message dicts and renders it with `encoding.render_messages`, so the prompt follows
DeepSeek's reference `encoding.py` while the library keeps doing request validation and stream parsing.

Mapping (checked against the library's own V4.1 rendering in tests/serving/test_chat_bridge.py):
- Conversation tools (unless tool_choice is "none") and the response format go on the first message when
  it is a system message, else on an empty system message inserted at index 0 (spec 16.2 rule 3). Tools
  render as `{"name", "description" ("" when absent), "parameters"}`, as the library renders a
  `ToolDefinition`. `json_object` renders `{"type": "json_object"}`; `json_schema` renders the schema itself
  (spec 7, the library's choice; the reference renders whatever object it is given); `regex` renders
  nothing.
- `AssistantMessage.prefix` -> `wo_eos`; image placeholders in content -> image content blocks.
- tool_choice "required" (a named function arrives as "required" with only that tool) -> the prompt ends
  with a newline pair + `<｜DSML｜ calls>` + newline, the prefill that the library's parsing options
  (`starts_in_tool_calls`) expect.

Where the library and the reference disagree, this follows the reference, except where the library's
parsing options (which the HTTP layer uses to parse the output) depend on the library's prompt:
- latest_reminder: the reference puts the generation header before the reminder, the library after it.
  Ours: the reference.
- A system message carrying its own tools (deferred tool loading): the library renders an "Updated Tool
  Schemas" section, which the reference lacks; ours renders them as the reference renders message tools.
- A typed image placeholder in text: the library keeps it as text, the reference refuses it; so do we.
- A trailing assistant message without `prefix`: the reference opens no generation header after it (the
  prompt ends with EOS), the library opens one. Ours: the reference's rendering plus the header the
  reference writes after a final user turn (`<｜Assistant｜>` + `<think>` or `</think>`). In thinking
  mode the library also drops that message's reasoning; ours keeps it, as the reference keeps reasoning
  after the last user turn.
- A thinking-mode prefix with empty content: the reference always closes `</think>`; the library continues
  the reasoning (the prompt ends `<think>` + reasoning so far) and parses from there. Ours follows the
  library here, or the stream parser would read the answer as reasoning.
"""

from __future__ import annotations

from typing import Any

import deepseek_recipe as d

from ced_jax.chat.encoding import (
    ASSISTANT,
    DSML,
    EFFORT_BUDGETS,
    IMAGE,
    THINK_END,
    THINK_START,
    ChatFormatError,
    RenderedPrompt,
    render_messages,
)

# The library's effort names -> prompt budget (its `xhigh` is the hosted alias of high, spec 3.2).
_CONVERSATION_EFFORTS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
_IMAGE_URL_PREFIX = "deepseek-recipe-image:"


def _tool_function(tool: d.ToolDefinition) -> dict:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters},
    }


def _content(message: d.Message, field: str, sources: list) -> Any:
    """The message text, or content blocks when it holds image placeholders (one per image source)."""
    text = message.content
    images = list(message.image_sources)
    if not images:
        return text
    pieces = text.split(IMAGE, len(images))
    if len(pieces) != len(images) + 1:
        raise ChatFormatError(f"{field}: {len(images)} images but fewer placeholders in the content")
    # The library joins text parts and placeholders with "\n\n"; the encoder joins content blocks the same
    # way, so cut each "\n\n" next to a placeholder and check the blocks give back the same text.
    blocks: list[dict] = []
    for i, piece in enumerate(pieces):
        if i > 0:
            piece = piece.removeprefix("\n\n")
            blocks.append({"type": "image_url", "image_url": {"url": f"{_IMAGE_URL_PREFIX}{len(sources)}"}})
            sources.append(images[i - 1])
        if i < len(pieces) - 1:
            piece = piece.removesuffix("\n\n")
        if piece:
            blocks.append({"type": "text", "text": piece})
    joined = "\n\n".join(IMAGE if b["type"] == "image_url" else b["text"] for b in blocks)
    if joined != text:
        raise ChatFormatError(f"{field}: image placeholder typed inside text; give images as content blocks")
    return blocks


def conversation_messages(conv: d.Conversation, sources: list) -> list[dict]:
    """The conversation's messages in the reference encoder's dict format (appends image sources in order)."""
    out: list[dict] = []
    for i, m in enumerate(conv.messages):
        field = f"messages[{i}]"
        if isinstance(m, d.SystemMessage):
            msg: dict[str, Any] = {"role": "system", "content": _content(m, field, sources)}
            if m.tools:
                msg["tools"] = [_tool_function(t) for t in m.tools]
        elif isinstance(m, d.UserMessage):
            msg = {"role": "user", "content": _content(m, field, sources)}
        elif isinstance(m, d.AssistantMessage):
            msg = {"role": "assistant", "content": m.content}
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": tc.name, "arguments": tc.arguments},
                    }
                    for tc in m.tool_calls
                ]
            if m.prefix:
                msg["wo_eos"] = True
        elif isinstance(m, d.ToolMessage):
            msg = {
                "role": "tool",
                "tool_call_id": m.tool_call_id or "",
                "content": _content(m, field, sources),
            }
        elif isinstance(m, d.LatestReminderMessage):
            msg = {"role": "latest_reminder", "content": m.content}
        else:
            raise ChatFormatError(f"{field}: unsupported message type {type(m).__name__}")
        out.append(msg)

    tools = [_tool_function(t) for t in conv.tools] if conv.tool_choice != "none" else []
    if conv.response_format == "json_object":
        response_format: Any = {"type": "json_object"}
    elif conv.response_format == "json_schema":
        response_format = conv.response_schema
    else:
        response_format = None
    if tools or response_format is not None:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        if tools:
            out[0]["tools"] = tools + out[0].get("tools", [])
        if response_format is not None:
            out[0]["response_format"] = response_format
    return out


def render_conversation(
    conv: d.Conversation, *, effort: int | None = None, thinking: bool | None = None
) -> RenderedPrompt:
    """Render a converted conversation with our encoder.

    `effort`: the prompt budget 1..100 (from `resolve_thinking`, which also covers integer efforts and the
    seed's `thinking.effort` the library ignores); None = the conversation's own effort (low 50, high/xhigh
    75, max 100, absent 75). `thinking`: overrides `conv.thinking_mode`. `images` of the result are the
    library's `ImageSource`s, one per placeholder.
    """
    thinking_mode = conv.thinking_mode if thinking is None else thinking
    if effort is None:
        effort = _CONVERSATION_EFFORTS.get(conv.reasoning_effort or "high", EFFORT_BUDGETS["high"])
    sources: list = []
    messages = conversation_messages(conv, sources)

    tail = ""
    last = messages[-1] if messages else None
    reasoning_continues = (
        thinking_mode
        and last is not None
        and last["role"] == "assistant"
        and last.get("wo_eos")
        and not last["content"]
    )
    if reasoning_continues:
        # The prompt ends inside the reasoning: header (rendered for the turn before) + the reasoning so far.
        tail = last.get("reasoning_content") or ""
        messages = messages[:-1]
    rendered = render_messages(
        messages, thinking_mode="thinking" if thinking_mode else "chat", reasoning_effort=effort
    )
    prompt, ranges = rendered.prompt + tail, list(rendered.special_ranges)

    def add_special(token: str) -> None:
        nonlocal prompt
        ranges.append((len(prompt), len(prompt) + len(token)))
        prompt += token

    if last is not None and last["role"] == "assistant" and not last.get("wo_eos"):
        # The reference opens no turn after a complete assistant message; a server must, to generate.
        add_special(ASSISTANT)
        add_special(THINK_START if thinking_mode else THINK_END)
    if conv.tool_choice == "required" and conv.tools:
        prompt += "\n\n<"
        add_special(DSML)
        prompt += " calls>\n"

    images = []
    for record in rendered.images:
        url = record.get("url", "")
        if not isinstance(url, str) or not url.startswith(_IMAGE_URL_PREFIX):
            raise ChatFormatError("messages: image without a converted source")
        images.append(sources[int(url.removeprefix(_IMAGE_URL_PREFIX))])
    return RenderedPrompt(prompt=prompt, images=images, special_ranges=ranges)
