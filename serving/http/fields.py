"""Every top-level request field of each HTTP API, and what this server does with it.

A field is IMPLEMENTED, an EXTENSION (ours or vLLM's name, not the hosted API's), a NO_OP (accepted and
ignored, as the hosted API ignores it too), or REFUSED (400 naming it, saying what to send instead). A
field in no table is refused as unknown: nothing a client sends is dropped without a word. A REFUSED
field with `allowed` values is accepted when it holds one of them (its default, which asks for nothing).

`docs/api-fields.md` is generated from these tables (`python -m serving.http.fields > docs/api-fields.md`;
a test keeps it in step).
"""

from __future__ import annotations

import dataclasses
import enum
import sys

from serving.http.errors import ApiError

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "chat", "completions", "responses", "messages"


class Handling(enum.Enum):
    IMPLEMENTED = "implemented"
    EXTENSION = "extension"
    NO_OP = "accepted, no effect"
    REFUSED = "refused (400)"


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    handling: Handling
    note: str
    allowed: tuple = ()  # REFUSED only: values that ask for nothing, accepted as such


I, X, N, R = Handling.IMPLEMENTED, Handling.EXTENSION, Handling.NO_OP, Handling.REFUSED

_SAMPLING_EXTENSIONS = (
    Field("top_k", X, "keep the k most likely tokens (0: off), in every mode"),
    Field("stop_token_ids", X, "token ids that end generation (not returned), as vLLM's"),
    Field("ignore_eos", X, "generate through end-of-sentence tokens to the limit, as vLLM's"),
    Field("prefill_mode", X, '"exact" or "ced": how the prompt is prefilled (default: --prefill-mode)'),
)
_PENALTIES = (
    Field("presence_penalty", N, "in [-2, 2]; the hosted API ignores it (deepseek-recipe drops it)"),
    Field("frequency_penalty", N, "in [-2, 2]; the hosted API ignores it (deepseek-recipe drops it)"),
)
_OPENAI_BOOKKEEPING = (
    Field("metadata", N, "OpenAI's stored-completion tags; nothing is stored"),
    Field("store", N, "nothing is stored (as the hosted API)"),
    Field("service_tier", N, "one tier is served"),
    Field("prompt_cache_key", N, "the prefix cache needs no key: it matches prompts by content"),
    Field("safety_identifier", N, "no content-safety service runs here; `user` scopes the cache"),
)

TABLES: dict[str, tuple[Field, ...]] = {
    CHAT: (
        Field("model", I, "the served name or an alias (GET /v1/models)"),
        Field("messages", I, "system / user / assistant / tool; text and image parts; `prefix` on the last"),
        Field("stream", I, "SSE, ends with `data: [DONE]`"),
        Field("stream_options", I, "`include_usage`"),
        Field("max_tokens", I, "[1, 393216], at most --max-tokens-limit; default by mode (8192 / 65536)"),
        Field("max_completion_tokens", I, "as max_tokens (the OpenAI SDK's name); both given: the smaller"),
        Field("temperature", I, "[0, 2]; thinking mode: fixed 1.0 (as the hosted API)"),
        Field("top_p", I, "thinking: clamped to [0.95, 1]; non-thinking: 1.0 (as the hosted API)"),
        Field("seed", I, "[0, 2^64); the same seed gives the same tokens"),
        Field("stop", I, "a string or up to 16; matched in the answer, not returned"),
        Field("logprobs", I, "per-token log-probabilities"),
        Field("top_logprobs", I, "[0, 20], at most --max-logprobs"),
        Field("n", I, "1 only (as the hosted API)"),
        Field(
            "response_format", I, "text, json_object, json_schema (strict), regex: enforced while decoding"
        ),
        Field("tools", I, "function tools"),
        Field(
            "tool_choice",
            I,
            "none / auto / required / a named function; required and named in thinking mode too",
        ),
        Field("parallel_tool_calls", I, "false: at most one call"),
        Field("thinking", I, '{"type": "enabled" | "disabled" | "adaptive"}; default enabled'),
        Field("reasoning_effort", I, "low / medium / high / max (and the hosted aliases), or 1-100"),
        Field("user_id", I, "the end user: scopes the prefix cache and request ids (without API keys)"),
        Field("user", I, "as user_id when user_id is absent"),
        Field("fim", X, '{"prompt", "suffix"}: fill in the middle on this route (the seeds\' probe)'),
        *_SAMPLING_EXTENSIONS,
        *_PENALTIES,
        *_OPENAI_BOOKKEEPING,
        Field("verbosity", N, "OpenAI's answer-length hint; DeepSeek's models take none"),
        Field(
            "logit_bias",
            R,
            "per-token biases are not applied; use stop_token_ids or response_format",
            allowed=({},),
        ),  # fmt: skip
        Field("functions", R, "deprecated by OpenAI; send `tools`"),
        Field("function_call", R, "deprecated by OpenAI; send `tool_choice`"),
        Field("audio", R, "the model has no audio output"),
        Field(
            "modalities", R, 'the model answers in text only; send ["text"] or omit it', allowed=(["text"],)
        ),
        Field("prediction", R, "predicted outputs are not used; speculative decoding is --dspark"),
        Field("web_search_options", R, "no search tool runs here; declare your own tool"),
    ),
    COMPLETIONS: (
        Field("model", I, "the served name or an alias"),
        Field("prompt", I, "a string (or a list of one string)"),
        Field("suffix", I, "given: fill in the middle (prompt, hole, suffix); absent: a plain completion"),
        Field("max_tokens", I, "[1, 4096] with a suffix (the hosted FIM limit), else [1, 393216]"),
        Field("temperature", I, "[0, 2]"),
        Field("top_p", I, "(0, 1]"),
        Field("seed", I, "[0, 2^64)"),
        Field("stop", I, "a string or up to 16; not returned"),
        Field("logprobs", I, "[0, 20]: the chosen token's and this many alternatives' log-probabilities"),
        Field("echo", I, "return the prompt before the completion"),
        Field("stream", I, "SSE, ends with `data: [DONE]`"),
        Field("stream_options", I, "`include_usage`"),
        Field("n", I, "1 only"),
        Field("thinking", I, "FIM and completions are non-thinking only: enabled is a 400"),
        Field("reasoning_effort", I, "only `none` (completions are non-thinking)"),
        Field("user", I, "the end user (scopes the prefix cache without API keys)"),
        *_SAMPLING_EXTENSIONS,
        *_PENALTIES,
        Field("best_of", R, "one completion is generated per request", allowed=(1,)),
        Field("logit_bias", R, "per-token biases are not applied; use stop_token_ids", allowed=({},)),
    ),
    RESPONSES: (
        Field("model", I, "the served name or an alias"),
        Field("input", I, "a string or items (messages, function calls and outputs, reasoning)"),
        Field("instructions", I, "the first system message"),
        Field("max_output_tokens", I, "as chat max_tokens"),
        Field("temperature", I, "as chat"),
        Field("top_p", I, "as chat"),
        Field("top_logprobs", I, "[0, 20]"),
        Field("stream", I, "SSE events (no [DONE])"),
        Field("stream_options", N, "include_obfuscation: no obfuscation is added"),
        Field("tools", I, "function tools, namespaces, apply_patch"),
        Field("tool_choice", I, "none / auto / required / a named function"),
        Field("parallel_tool_calls", I, "false: at most one call"),
        Field("max_tool_calls", I, "the most calls in the answer"),
        Field("reasoning", I, "`effort` (none disables thinking); `summary` is ignored"),
        Field("text", I, "`format`: text, json_object, json_schema"),
        Field("user", I, "the end user (scopes the prefix cache without API keys)"),
        Field("include", N, "nothing extra is returned (no encrypted reasoning, no search results)"),
        Field("truncation", N, "never truncated: an over-long input is a 400"),
        Field("seed", X, "[0, 2^64)"),
        *_SAMPLING_EXTENSIONS,
        *_OPENAI_BOOKKEEPING,
        Field("previous_response_id", R, "no responses are stored; send the whole conversation in `input`"),
        Field("conversation", R, "no conversations are stored; send the whole conversation in `input`"),
        Field("background", R, "requests run in the foreground; stream instead", allowed=(False,)),
        Field("prompt", R, "no stored prompt templates; send `instructions` and `input`"),
    ),
    MESSAGES: (
        Field("model", I, "the served name, an alias, or any claude-* name"),
        Field("messages", I, "text, image, thinking, tool_use and tool_result blocks"),
        Field("max_tokens", I, "required by the SDK; at most --max-tokens-limit"),
        Field("system", I, "a string or text blocks"),
        Field("stop_sequences", I, "up to 16; not returned"),
        Field("stream", I, "SSE events"),
        Field("temperature", I, "[0, 2]; thinking mode: fixed 1.0"),
        Field("top_p", I, "as chat"),
        Field("top_k", I, "keep the k most likely tokens (the hosted API ignores it; applied here)"),
        Field("tools", I, "name, description, input_schema"),
        Field("tool_choice", I, "auto / any / tool / none, each enforced by the grammar"),
        Field("thinking", I, '{"type": "enabled" | "disabled" | "adaptive"}; `budget_tokens` ignored'),
        Field("output_config", I, "`effort`"),
        Field("metadata", I, "`user_id`: the end user (scopes the prefix cache without API keys)"),
        Field("seed", X, "[0, 2^64)"),
        *(f for f in _SAMPLING_EXTENSIONS if f.name != "top_k"),
        Field("service_tier", N, "one tier is served"),
        Field("container", R, "no code-execution container runs here"),
        Field("mcp_servers", R, "no MCP client runs here; declare the tools yourself"),
        Field("context_management", R, "the context is never edited; send what the model should see"),
    ),
}

_BY_NAME = {api: {f.name: f for f in table} for api, table in TABLES.items()}
_ROUTE = {CHAT: "chat completions", COMPLETIONS: "completions", RESPONSES: "responses", MESSAGES: "messages"}


def check_fields(api: str, body: dict) -> None:
    """400 naming the first field of `body` that `api` refuses or does not know."""
    table = _BY_NAME[api]
    for name, value in body.items():
        field = table.get(name)
        if field is None:
            raise ApiError(
                400,
                f"{name}: unknown field for {_ROUTE[api]}; this server does not drop fields silently "
                "(the fields it takes: docs/api-fields.md)",
                param=name,
            )
        if field.handling is Handling.REFUSED and value is not None and value not in field.allowed:
            raise ApiError(400, f"{name}: not supported: {field.note}", param=name)


def markdown() -> str:
    """docs/api-fields.md."""
    out = [
        "# Request fields of the HTTP API",
        "",
        "Generated from `serving/http/fields.py` (`python -m serving.http.fields > docs/api-fields.md`).",
        "Every top-level field a route takes, and what the server does with it. A field not listed is",
        "refused with 400 naming it; a refused field is accepted only with the value that asks for nothing",
        '(`logit_bias: {}`, `modalities: ["text"]`, `best_of: 1`, `background: false`).',
    ]
    titles = {
        CHAT: "Chat Completions (`/chat/completions`, `/v1/chat/completions`, `/beta/...`)",
        COMPLETIONS: "Completions (`/completions`, `/v1/completions`, `/beta/completions`)",
        RESPONSES: "Responses (`/responses`, `/v1/responses`)",
        MESSAGES: "Anthropic Messages (`/v1/messages`, `/anthropic/v1/messages`)",
    }
    for api, table in TABLES.items():
        out += ["", f"## {titles[api]}", "", "| field | handling | notes |", "|---|---|---|"]
        out += [f"| `{f.name}` | {f.handling.value} | {f.note.replace('|', '/')} |" for f in table]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
