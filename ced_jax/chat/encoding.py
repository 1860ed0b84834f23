"""DeepSeek-V4.1 chat encoding: messages -> prompt string, prompt -> token ids, completion -> message.

Why our own encoder: DeepSeek's reference `encoding/encoding.py` defines the V4.1 prompt format, and the
serving layer must reproduce it exactly. deepseek-recipe 0.2.0 (the shipping DeepSeek library) renders
the common cases identically but cannot express an integer effort (1-100), `drop_thinking=False`,
quick-instruction `task` tokens, `context`, `add_default_bos_token=False` or image content blocks in the
reference's dict format, and it renders `latest_reminder` and a full `json_schema` response_format object
differently. So this module follows the reference rule for rule (checked against the golden set
`tests/golden/chat-encoding`, computed by the reference itself), while deepseek-recipe stays the HTTP
request converter and streaming parser and serves as a second oracle in tests.

Messages use the reference's dict format: roles system/user/assistant/tool/latest_reminder; `tools` and
`response_format` on a message (normally the first system message); OpenAI-format `tool_calls`;
`reasoning_content`; `wo_eos` (assistant prefix, no EOS); `task` (quick-instruction token); content as a
string or a list of blocks (`text`, `image_url`, `image`, `tool_result`).

Special tokens are tracked while rendering: `RenderedPrompt.special_ranges` lists only the tokens the
renderer placed, so text a client typed (say `<｜end▁of▁sentence｜>` in a user message) is tokenized as
plain text by `encode_prompt` and can never become a control token.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

import tokenizers

from ced_jax.text_ids import encode_ids

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
# The reference's named efforts (post-release table, HF revision df42c109 onward); see spec 3.2.
EFFORT_BUDGETS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
THINKING_MODES = ("chat", "thinking")

# The opening of a tool-call block in a completion: the reference parser searches for exactly this.
TOOL_CALLS_OPEN = f"\n\n<{DSML} calls"


class ChatFormatError(ValueError):
    """A conversation or completion the V4.1 chat format cannot represent; the message says which field."""


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt.

    `images`: one record per image placeholder, in prompt order
    (`{"type": "image", "url"|"source"|"data": ...}`).
    `special_ranges`: half-open code-point ranges `(start, end)` of `prompt`, ascending, each holding one
    special token that the renderer placed; everything else is plain text.
    """

    prompt: str
    images: list
    special_ranges: list[tuple[int, int]]


# ---------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------

# Candidate marker characters (Unicode private use). The renderer wraps every special token it places in a
# marker pair, so after rendering it knows which spellings are control tokens and which are client text; the
# marker is one that occurs in no input string.
_MARKER_CANDIDATES = [chr(c) for c in range(0xE000, 0xF900)]


def _strings(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(k, out)
            _strings(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _strings(v, out)
    elif value is not None and not isinstance(value, bool | int | float):
        out.append(str(value))


def _pick_marker(*inputs: Any) -> str:
    texts: list[str] = []
    for value in inputs:
        _strings(value, texts)
    used = set("".join(texts))
    for c in _MARKER_CANDIDATES:
        if c not in used:
            return c
    raise ChatFormatError("messages use every private-use character; cannot track special tokens")


def _to_json(value: Any) -> str:
    # The reference tries ensure_ascii=False first and falls back to ASCII escapes.
    try:
        return json.dumps(value, ensure_ascii=False)
    except Exception:
        try:
            return json.dumps(value, ensure_ascii=True)
        except Exception as e:
            raise ChatFormatError(f"value is not JSON-serializable: {e}") from None


def _effort_budget(effort: str | int | None) -> int:
    if effort is None:
        effort = DEFAULT_EFFORT
    # bool is excluded on purpose (the reference checks `type(effort) is int`).
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in EFFORT_BUDGETS:
        return EFFORT_BUDGETS[effort]
    raise ChatFormatError(
        f"reasoning_effort: invalid value {effort!r}; expected an integer in [1, 100] or one of "
        f"{list(EFFORT_BUDGETS)}"
    )


def _check_no_image_token(text: Any, field: str) -> None:
    if isinstance(text, str) and IMAGE in text:
        raise ChatFormatError(
            f"{field}: contains the image placeholder {IMAGE!r}; images must be given as image content blocks"
        )


def _image_record(block: dict, field: str) -> dict:
    record: dict[str, Any] = {"type": "image"}
    if block.get("type") == "image_url":
        image_url = block.get("image_url")
        if isinstance(image_url, str):
            record["url"] = image_url
        elif image_url is None or isinstance(image_url, dict):
            record["url"] = (image_url or {}).get("url", "")
        else:
            raise ChatFormatError(f"{field}.image_url: expected a string or an object with `url`")
    else:
        for key in ("source", "url", "data"):
            if key in block:
                record[key] = block[key]
    if not any(record.get(key) for key in ("source", "url", "data")):
        raise ChatFormatError(f"{field}: image block has no source (`url`, `source` or `data`)")
    return record


class _Renderer:
    """One render call; `sp(token)` marks a special token in the output."""

    def __init__(self, marker: str, thinking_mode: str, effort: str | int | None):
        self.m = marker
        self.thinking = thinking_mode == "thinking"
        self.thinking_mode = thinking_mode
        self.effort = effort

    def sp(self, token: str) -> str:
        return f"{self.m}{token}{self.m}"

    # -- image blocks --------------------------------------------------------------------------------------

    def _replace_images(self, blocks: list, field: str, images: list) -> list:
        out = []
        for i, block in enumerate(blocks):
            where = f"{field}[{i}]"
            if not isinstance(block, dict):
                out.append(block)
            elif block.get("type") in ("image", "image_url"):
                out.append({"type": "text", "text": self.sp(IMAGE)})
                images.append(_image_record(block, where))
            elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
                block = copy.copy(block)
                block["content"] = self._replace_images(block["content"], f"{where}.content", images)
                out.append(block)
            elif block.get("type") == "text":
                text = block.get("text") or ""
                if not isinstance(text, str):
                    raise ChatFormatError(f"{where}.text: expected a string")
                _check_no_image_token(text, f"{where}.text")
                out.append(block)
            else:
                out.append(block)
        return out

    def preprocess_images(self, messages: list, field: str) -> tuple[list, list]:
        processed, images = [], []
        for i, msg in enumerate(messages):
            where = f"{field}[{i}]"
            if not isinstance(msg, dict):
                raise ChatFormatError(f"{where}: expected an object")
            msg = copy.deepcopy(msg)
            _check_no_image_token(msg.get("content"), f"{where}.content")
            _check_no_image_token(msg.get("reasoning_content"), f"{where}.reasoning_content")
            if isinstance(msg.get("content"), list) and "content_blocks" not in msg:
                msg["content_blocks"] = msg.pop("content")
            if msg.get("content_blocks"):
                msg["content_blocks"] = self._replace_images(
                    msg["content_blocks"], f"{where}.content", images
                )
                if not isinstance(msg.get("content"), str):
                    texts = [
                        b.get("text", "")
                        for b in msg["content_blocks"]
                        if isinstance(b, dict) and b.get("type") == "text"
                    ]
                    msg["content"] = _join_texts(texts, f"{where}.content")
            processed.append(msg)
        return processed, images

    # -- one message -----------------------------------------------------------------------------------------

    def _tools_section(self, tools: list) -> str:
        d = self.sp(DSML)
        block = f"<{d} calls>"
        invoke = f"{d} invoke"
        param = f"{d} parameter"
        schemas = "\n".join(_to_json(t) for t in tools)
        return (
            "## Tools\n\nYou have access to a set of tools to help answer the user's question. "
            "You can invoke tools "
            f'by writing a "{block}" block like the following:\n\n'
            f"{block}\n"
            f'<{invoke} name="$TOOL_NAME">\n'
            f'<{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{param}>\n'
            "...\n"
            f"</{invoke}>\n"
            f'<{invoke} name="$TOOL_NAME2">\n'
            "...\n"
            f"</{invoke}>\n"
            f"</{d} calls>\n\n"
            'String parameters should be specified as is and set `string="true"`. '
            "For all other types (numbers, "
            'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
            f"If thinking_mode is enabled (triggered by {self.sp(THINK_START)}), "
            "you MUST output your complete "
            f"reasoning inside {self.sp(THINK_START)}...{self.sp(THINK_END)} BEFORE any tool calls or final "
            "response.\n\n"
            f"Otherwise, output directly after {self.sp(THINK_END)} with tool calls or final response.\n\n"
            "### Available Tool Schemas\n\n"
            f"{schemas}\n\n"
            "You MUST strictly follow the above defined tool name and parameter schemas "
            "to invoke tool calls.\n"
        )

    def _tool_call(self, name: Any, arguments: Any) -> str:
        d = self.sp(DSML)
        args = arguments
        if not isinstance(args, dict):
            # Like the reference: accept a JSON string, even a doubly encoded one; anything that does not
            # decode to an object is passed as a single string parameter `arguments`.
            for _ in range(2):
                if not isinstance(args, str):
                    break
                try:
                    args = json.loads(args)
                except Exception:
                    break
            if not isinstance(args, dict):
                args = {"arguments": arguments}
        params = []
        for k, v in args.items():
            is_str = isinstance(v, str)
            value = v if is_str else _to_json(v)
            params.append(
                f'<{d} parameter name="{k}" string="{"true" if is_str else "false"}">{value}</{d} parameter>'
            )
        body = "\n".join(params)
        return f'<{d} invoke name="{name}">\n{body}\n</{d} invoke>'

    def _user_blocks(self, blocks: list, field: str) -> str:
        parts = []
        for i, block in enumerate(blocks):
            where = f"{field}[{i}]"
            if not isinstance(block, dict):
                raise ChatFormatError(f"{where}: expected a content block object")
            kind = block.get("type")
            if kind == "text":
                parts.append(block.get("text", ""))
            elif kind == "tool_result":
                result = block.get("content", "")
                if isinstance(result, list):
                    texts = []
                    for j, b in enumerate(result):
                        if not isinstance(b, dict):
                            raise ChatFormatError(f"{where}.content[{j}]: expected a content block object")
                        texts.append(
                            b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                        )
                    result = _join_texts(texts, f"{where}.content")
                parts.append(f"<tool_result>{result}</tool_result>")
            else:
                parts.append(f"[Unsupported {kind}]")
        return _join_texts(parts, field)

    def message(self, index: int, messages: list, drop_thinking: bool) -> str:
        msg = messages[index]
        field = f"messages[{index}]"
        last_user = _last_user_index(messages)
        role = msg.get("role")
        content = msg.get("content")
        tools = msg.get("tools")
        response_format = msg.get("response_format")
        tool_calls = msg.get("tool_calls")

        # The effort is validated for every rendered message, in either mode, as the reference does.
        budget = _effort_budget(self.effort)
        effort_line = ""
        if index == 0 and self.thinking:
            effort_line = (
                f"Reasoning Effort: {budget} "
                "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
            )
        out = self.sp(SYSTEM) if index == 0 and (effort_line or role == "system") else ""
        out += effort_line

        if role == "system":
            if index > 0:
                out += self.sp(SYSTEM)
            out += f"{content or ''}"
            if tools:
                out += "\n\n" + self._tools_section(_tool_functions(tools, f"{field}.tools"))
            if response_format:
                out += (
                    "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                    + _to_json(response_format)
                )
        elif role == "user":
            out += self.sp(USER)
            blocks = msg.get("content_blocks")
            if blocks:
                out += self._user_blocks(blocks, f"{field}.content")
            else:
                text = content or ""
                if not isinstance(text, str):
                    raise ChatFormatError(f"{field}.content: expected a string or content blocks")
                out += text
        elif role == "latest_reminder":
            # The reference formats the content as is (a missing content renders as "None").
            out += self.sp(LATEST_REMINDER) + f"{content}"
        elif role == "assistant":
            calls = ""
            if tool_calls:
                rendered = [
                    self._tool_call(name, args)
                    for name, args in _tool_call_parts(tool_calls, f"{field}.tool_calls")
                ]
                d = self.sp(DSML)
                calls = "\n\n" + f"<{d} calls>\n" + "\n".join(rendered) + f"\n</{d} calls>"
            reasoning = ""
            # An assistant turn answering a quick-instruction task has no reasoning part.
            after_task = index >= 1 and messages[index - 1].get("task") is not None
            if self.thinking and not after_task and (not drop_thinking or index > last_user):
                reasoning = f"{msg.get('reasoning_content') or ''}" + self.sp(THINK_END)
            out += reasoning + f"{content or ''}" + calls
            if not msg.get("wo_eos", False):
                out += self.sp(EOS)
        else:
            raise ChatFormatError(
                f"{field}.role: unsupported role {role!r}; "
                "expected system, user, assistant, tool or latest_reminder"
            )

        # What follows the message: nothing when a non-assistant turn comes next.
        if index + 1 < len(messages) and messages[index + 1].get("role") not in (
            "assistant",
            "latest_reminder",
        ):
            return out
        task = msg.get("task")
        if task is not None:
            if not isinstance(task, str) or task not in TASK_TOKENS:
                raise ChatFormatError(
                    f"{field}.task: invalid task {task!r}; expected one of {list(TASK_TOKENS)}"
                )
            if task != "action":
                out += self.sp(TASK_TOKENS[task])
            else:
                out += self.sp(ASSISTANT) + self.sp(THINK_START if self.thinking else THINK_END)
                out += self.sp(TASK_TOKENS[task])
        elif role == "user" or (role == "system" and index > 0):
            # A generation header; a mid-conversation system message opens one like a user turn.
            out += self.sp(ASSISTANT)
            if self.thinking and (not drop_thinking or index >= last_user):
                out += self.sp(THINK_START)
            else:
                out += self.sp(THINK_END)
        return out


def _join_texts(parts: list, field: str) -> str:
    for p in parts:
        if not isinstance(p, str):
            raise ChatFormatError(f"{field}: text must be a string, got {type(p).__name__}")
    return "\n\n".join(parts)


def _tool_functions(tools: Any, field: str) -> list:
    if not isinstance(tools, list):
        raise ChatFormatError(f"{field}: expected a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or "function" not in tool:
            raise ChatFormatError(f"{field}[{i}]: expected an OpenAI tool with a `function` object")
        out.append(tool["function"])
    return out


def _tool_call_parts(tool_calls: Any, field: str) -> list[tuple[Any, Any]]:
    if not isinstance(tool_calls, list):
        raise ChatFormatError(f"{field}: expected a list of tool calls")
    out = []
    for i, tc in enumerate(tool_calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or "name" not in fn or "arguments" not in fn:
            raise ChatFormatError(f"{field}[{i}].function: expected an object with `name` and `arguments`")
        out.append((fn.get("name"), fn["arguments"]))
    return out


def _last_user_index(messages: list) -> int:
    # A mid-conversation system message counts as a user turn.
    for idx in range(len(messages) - 1, -1, -1):
        role = messages[idx].get("role")
        if role == "user" or (role == "system" and idx > 0):
            return idx
    return -1


def _merge_tool_messages(messages: list) -> list:
    """V4.1 has no tool role: tool results become `tool_result` blocks of a user turn; users merge."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        prev_user = bool(merged) and merged[-1].get("role") == "user" and "content_blocks" in merged[-1]
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": msg.get("tool_call_id", ""),
                "content": msg.get("content", ""),
            }
            if prev_user:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = msg.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": msg.get("content", "")}]
            if prev_user and merged[-1].get("task") is None:
                merged[-1]["content_blocks"].extend(blocks)
            else:
                msg["content_blocks"] = blocks
                merged.append(msg)
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list) -> list:
    """Order the tool results of a user turn as the calls of the latest assistant turn with calls."""
    order: dict[str, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            order = {}
            for idx, tc in enumerate(msg["tool_calls"]):
                tc_id = tc.get("id") or tc.get("function", {}).get("id", "")
                if tc_id:
                    order[tc_id] = idx
        elif role == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                # Stable sort; a result whose id matches no call sorts as the first call.
                ordered = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [
                    next(ordered) if b.get("type") == "tool_result" else b for b in msg["content_blocks"]
                ]
    return messages


def _drop_reasoning(messages: list) -> list:
    """Before the last user turn: assistant reasoning is removed; turns of roles outside `keep` vanish."""
    last_user = _last_user_index(messages)
    keep = {"user", "system", "tool", "latest_reminder", "direct_search_results"}
    out = []
    for idx, msg in enumerate(messages):
        role = msg.get("role")
        if role in keep or idx >= last_user:
            out.append(msg)
        elif role == "assistant":
            msg = copy.copy(msg)
            msg.pop("reasoning_content", None)
            out.append(msg)
    return out


def render_messages(
    messages: list[dict],
    *,
    thinking_mode: str,
    reasoning_effort: str | int | None = None,
    context: list[dict] | None = None,
    drop_thinking: bool = True,
    add_default_bos_token: bool = True,
) -> RenderedPrompt:
    """Render messages into a V4.1 prompt, exactly as the reference `encode_messages` does.

    `context`: earlier messages already in the KV cache; they steer the rendering (tool-result order,
    reasoning dropping, message indices) but are not rendered, and no BOS is added.
    `reasoning_effort`: "low"/"high"/"max" or an integer budget 1..100, None = "high"; rendered only in
    thinking mode but validated in both.
    """
    if not isinstance(messages, list):
        raise ChatFormatError("messages: expected a list")
    if context is not None and not isinstance(context, list):
        raise ChatFormatError("context: expected a list")
    renderer = _Renderer(_pick_marker(messages, context), thinking_mode, reasoning_effort)
    try:
        prompt, images = _render(renderer, messages, context or [], drop_thinking, add_default_bos_token)
    except ChatFormatError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        # Shapes the reference does not accept either (it fails with the same exception kinds).
        raise ChatFormatError(f"messages: malformed message ({type(e).__name__}: {e})") from None
    return _strip_markers(prompt, renderer.m, images)


def _render(renderer: _Renderer, messages: list, context: list, drop_thinking: bool, add_bos: bool):
    context, _ = renderer.preprocess_images(context, "context") if context else ([], [])
    messages, images = renderer.preprocess_images(messages, "messages")

    messages = _merge_tool_messages(messages)
    messages = _sort_tool_results(context + messages)[len(context) :]
    if context:
        context = _sort_tool_results(_merge_tool_messages(context))
    full = context + messages

    out = renderer.sp(BOS) if add_bos and not context else ""
    # Tools anywhere in the conversation keep every turn's reasoning (tool-use turns need it).
    drop = drop_thinking and not any(m.get("tools") for m in full)
    if renderer.thinking and drop:
        full = _drop_reasoning(full)
        n_render = len(full) - len(_drop_reasoning(context))
        start = len(full) - n_render
    else:
        n_render = len(messages)
        start = len(context)
    if n_render > 0 and renderer.thinking_mode not in THINKING_MODES:
        raise ChatFormatError(
            f"thinking_mode: invalid value {renderer.thinking_mode!r}; expected 'chat' or 'thinking'"
        )
    for idx in range(n_render):
        out += renderer.message(idx + start, full, drop)
    return out, images


def _strip_markers(marked: str, marker: str, images: list) -> RenderedPrompt:
    pieces = marked.split(marker)
    # Markers come in pairs around each special token: odd pieces are special tokens.
    assert len(pieces) % 2 == 1, "unbalanced special-token markers"
    text, ranges, pos = [], [], 0
    for i, piece in enumerate(pieces):
        if i % 2 == 1:
            ranges.append((pos, pos + len(piece)))
        text.append(piece)
        pos += len(piece)
    return RenderedPrompt(prompt="".join(text), images=images, special_ranges=ranges)


# ---------------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------------


class PromptEncoder:
    """Token ids of rendered prompts: special ids only inside `special_ranges`, plain text elsewhere.

    Plain text is encoded by a copy of the tokenizer without its added vocabulary, so a special-token
    spelling in client text becomes ordinary tokens. Build one per tokenizer and reuse it (the copy costs a
    serialization).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        spec = json.loads(tokenizer.to_str())
        added = spec.get("added_tokens", [])
        self._special_ids = {t["content"]: t["id"] for t in added}
        # Added tokens that swallow whitespace beside them, as the full tokenizer matches them.
        self._lstrip = {t["content"] for t in added if t.get("lstrip")}
        self._rstrip = {t["content"] for t in added if t.get("rstrip")}
        spec["added_tokens"] = []
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))

    def plain(self, text: str) -> list[int]:
        return encode_ids(self._plain, text, add_special_tokens=False) if text else []

    def encode(self, rendered: RenderedPrompt) -> list[int]:
        ids: list[int] = []
        run = ""  # plain text not yet encoded
        strip_next = False
        pos = 0
        prompt = rendered.prompt
        for start, end in rendered.special_ranges:
            run += prompt[pos:start]
            pos = end
            token = prompt[start:end]
            if token not in self._special_ids:
                # A token this vocabulary lacks (a task token in a small tokenizer) is plain text, encoded
                # together with its neighbours as the full tokenizer would.
                run += token
                continue
            if strip_next:
                run = run.lstrip()
            if token in self._lstrip:
                run = run.rstrip()
            ids += self.plain(run)
            ids.append(self._special_ids[token])
            run, strip_next = "", token in self._rstrip
        run += prompt[pos:]
        ids += self.plain(run.lstrip() if strip_next else run)
        return ids


def encode_prompt(rendered: RenderedPrompt, tokenizer: tokenizers.Tokenizer | PromptEncoder) -> list[int]:
    """Token ids of `rendered` (no BOS added: the renderer writes it). Pass a `PromptEncoder` to reuse one."""
    encoder = tokenizer if isinstance(tokenizer, PromptEncoder) else PromptEncoder(tokenizer)
    return encoder.encode(rendered)


# ---------------------------------------------------------------------------------------------------------
# Parsing a completion
# ---------------------------------------------------------------------------------------------------------


def _read_until(text: str, index: int, stops: list[str]) -> tuple[int, str, str | None]:
    """(index after the earliest stop, text before it, the stop) or (len(text), rest, None)."""
    best, found = len(text), None
    for s in stops:
        pos = text.find(s, index)
        if pos != -1 and pos < best:
            best, found = pos, s
    if found is None:
        return len(text), text[index:], None
    return best + len(found), text[index:best], found


_NAME_RE = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAM_RE = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


def _parse_tool_calls(text: str, index: int) -> tuple[int, str | None, list[dict]]:
    calls_end = f"</{DSML} calls>"
    invoke_start, invoke_end = f"<{DSML} invoke", f"</{DSML} invoke"
    param_start, param_end = f"<{DSML} parameter", f"/{DSML} parameter"
    calls: list[dict] = []
    stop = None
    while index < len(text):
        index, between, stop = _read_until(text, index, [invoke_start, calls_end])
        if between != ">\n":
            raise ChatFormatError(f"tool calls: expected '>\\n' but got {between!r}")
        if stop == calls_end:
            break
        if stop is None:
            raise ChatFormatError("tool calls: missing special token in tool calls")
        index, head, stop = _read_until(text, index, [param_start, invoke_end])
        names = _NAME_RE.findall(head)
        if len(names) != 1:
            raise ChatFormatError(f"tool calls: malformed tool name {head!r}")
        params: dict[str, tuple[str, str]] = {}
        while stop == param_start:
            index, body, stop = _read_until(text, index, [param_end])
            found = _PARAM_RE.findall(body)
            if len(found) != 1:
                raise ChatFormatError(f"tool calls: malformed parameter {body!r}")
            pname, is_str, value = found[0]
            if pname in params:
                raise ChatFormatError(f"tool calls: duplicate parameter name {pname!r}")
            params[pname] = (value, is_str)
            index, between, stop = _read_until(text, index, [param_start, invoke_end])
            if between != ">\n":
                raise ChatFormatError(f"tool calls: expected '>\\n' after a parameter but got {between!r}")
        # Arguments as the reference builds them: string values JSON-quoted, the others copied raw.
        args = ", ".join(
            f"{_to_json(k)}: {_to_json(v) if is_str == 'true' else v}" for k, (v, is_str) in params.items()
        )
        calls.append({"name": names[0], "arguments": "{" + args + "}"})
    return index, stop, calls


def parse_completion(text: str, thinking_mode: str) -> dict:
    """Parse a completion (the text generated after the generation header), as the reference parser does.

    Returns {"role": "assistant", "content", "reasoning_content", "tool_calls"} with OpenAI-format tool calls
    (no ids). The completion must end with EOS unless it ends with a tool-call block.
    """
    if thinking_mode not in THINKING_MODES:
        raise ChatFormatError(
            f"thinking_mode: invalid value {thinking_mode!r}; expected 'chat' or 'thinking'"
        )
    reasoning, content, calls = "", "", []
    index, stop = 0, None
    if thinking_mode == "thinking":
        index, reasoning, stop = _read_until(text, index, [THINK_END, TOOL_CALLS_OPEN])
        if stop != THINK_END:
            raise ChatFormatError("completion: invalid thinking format: missing </think>")
    index, content, stop = _read_until(text, index, [EOS, TOOL_CALLS_OPEN])
    if stop == TOOL_CALLS_OPEN:
        index, stop, calls = _parse_tool_calls(text, index)
        index, trailing, stop = _read_until(text, index, [EOS])
        if trailing:
            raise ChatFormatError("completion: unexpected content after tool calls")
    elif stop != EOS:
        raise ChatFormatError("completion: invalid format: missing EOS token")
    if index != len(text) or stop not in (EOS, None):
        raise ChatFormatError("completion: unexpected content at end")
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise ChatFormatError(f"completion: unexpected special token {token!r} in content")
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [{"type": "function", "function": c} for c in calls],
    }
