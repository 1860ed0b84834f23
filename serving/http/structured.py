"""Structured output beyond what deepseek-recipe constrains: the engine's `OutputConstraint` for a
request (JSON schema / object, regex, tool calls), with a strict schema enforced as the client sent
it, forced tool calls in thinking mode and Anthropic `any`, and `tool_choice: none` as a text-only
grammar (`docs/http-api.md`)."""

from __future__ import annotations

import json

from serving.constraints import ConstraintError, OutputConstraint
from serving.http.errors import ApiError
from serving.http.fields import CHAT, MESSAGES, RESPONSES


def output_constraint(
    oc, thinking: bool, body: dict, api: str, think_end_id: int, forced: str | bool | None = None
) -> OutputConstraint | None:
    """The engine's constraint for deepseek-recipe's `output_constraint` (JSON schema / object, regex,
    a required or named tool call); in thinking mode it starts after `</think>`. The request's
    `parallel_tool_calls` (false: one call) and Responses' `max_tool_calls` bound the calls.
    `forced` (`forced_tools`): a tool call the request requires, True for any tool or a tool's name,
    which deepseek-recipe does not constrain (thinking mode, Anthropic `any`). A strict JSON schema
    is enforced as the client sent it (deepseek-recipe drops the keywords OpenAI's strict mode once
    lacked: minLength, maxItems, ...)."""
    if oc is None:
        if body.get("tools") and _no_tools(api, body.get("tool_choice")):
            # tool_choice none: the answer is text; no grammar path spells a special token, so the
            # tool-call marker cannot come (deepseek-recipe only stops parsing calls).
            return OutputConstraint(
                kind="regex", regex=r"(?s:.*)", start_after_token=think_end_id if thinking else None
            )
        return None
    parallel = body.get("parallel_tool_calls")
    max_calls = body.get("max_tool_calls")
    kind, schema = oc.kind, oc.schema
    if forced is not None and kind == "tool_call":  # every declared tool, as `auto` lists them
        tools = json.loads(schema) if isinstance(schema, str) else list(schema)
        if forced is not True:
            tools = [t for t in tools if _tool_name(t) == forced]
            if not tools:
                field = "tool_choice"
                raise ApiError(400, f"{field}: names {forced!r}, which is not in `tools`", param=field)
        kind, schema = "tool_call_required", json.dumps(tools)
    elif kind == "json" and schema:
        sent = _sent_schema(api, body)
        if sent is not None:
            schema = json.dumps(sent)
    try:
        return OutputConstraint.from_recipe(
            kind,
            schema,
            start_after_token=think_end_id if thinking else None,
            parallel_tool_calls=parallel if isinstance(parallel, bool) else True,
            max_tool_calls=max_calls if type(max_calls) is int else None,
        )
    except ConstraintError as e:
        field = "tools" if kind == "tool_call_required" else "text.format" if api == RESPONSES else None
        field = field or ("response_format" if api == CHAT else "request")
        raise ApiError(400, f"{field}: {e}", param=field) from None


def forced_tools(api: str, body: dict, thinking: bool) -> str | bool | None:
    """A tool call the request requires where deepseek-recipe would not constrain one: `tool_choice`
    required / named in thinking mode (it refuses those: the model then reasons first and must call
    after `</think>`), Anthropic `any` (it treats that as auto). True: any declared tool; a str: that
    tool. The body's choice is set to `auto` for the conversion; None: nothing forced here."""
    choice = body.get("tool_choice")
    if api == MESSAGES:
        if isinstance(choice, dict) and choice.get("type") == "any":
            body["tool_choice"] = {**choice, "type": "auto"}
            return True
        if (
            thinking
            and isinstance(choice, dict)
            and choice.get("type") == "tool"
            and isinstance(choice.get("name"), str)
        ):
            body["tool_choice"] = {k: v for k, v in choice.items() if k != "name"} | {"type": "auto"}
            return choice["name"]
        return None
    if not thinking or not body.get("tools"):
        return None
    if choice == "required":
        body["tool_choice"] = "auto"
        return True
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("function", {}).get("name") if api == CHAT else choice.get("name")
        if isinstance(name, str):
            body["tool_choice"] = "auto"
            return name
    return None


def _no_tools(api: str, choice) -> bool:
    """tool_choice none, as each API spells it."""
    return choice == {"type": "none"} if api == MESSAGES else choice == "none"


def _tool_name(tool: dict) -> str | None:
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return fn.get("name")


def _sent_schema(api: str, body: dict):
    """The JSON schema of the request's structured output as the client sent it (None if absent)."""
    if api == CHAT:
        rf = body.get("response_format")
        js = rf.get("json_schema") if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
        schema = js.get("schema") if isinstance(js, dict) else None
    elif api == RESPONSES:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        schema = fmt.get("schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    else:
        schema = None
    return schema if isinstance(schema, dict) else None
