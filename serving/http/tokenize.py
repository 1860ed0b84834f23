"""Token counting routes: `POST /tokenize` and `/detokenize` (vLLM's shapes) and Anthropic's
`POST /v1/messages/count_tokens`.

`/tokenize` takes `prompt` (plain text; `add_special_tokens`, default true, puts the BOS first, as a
plain completion is served) or `messages` plus any chat field (rendered exactly as a chat request,
images expanded to their spans), and answers `{"count", "max_model_len", "tokens"}` (and `token_strs`
when `return_token_strs` is true). `/detokenize` takes `tokens` and answers `{"prompt"}`.
"""

from __future__ import annotations

from serving.http.convert import CHAT, MESSAGES, SERVED_MODEL, Converter, body_field
from serving.http.errors import ApiError

_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}


def tokenize(converter: Converter, body: dict, identity: str) -> dict:
    strs = bool(body_field(body, "return_token_strs", (bool,), "a boolean"))
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(
            400, "request body: send either `prompt` (text) or `messages` (a chat)", param="prompt"
        )
    if "prompt" in body:
        unknown = sorted(set(body) - _PROMPT_FIELDS)
        if unknown:
            raise ApiError(400, f"{unknown[0]}: unknown field for /tokenize with a prompt", param=unknown[0])
        if body.get("model") is not None:
            converter.resolve_model(body["model"], anthropic=False)
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt: expected a string", param="prompt")
        converter.check_prompt_bytes("prompt", prompt)
        special = body_field(body, "add_special_tokens", (bool,), "a boolean")
        ids = ([converter.bos_id] if special is not False else []) + converter.encoder.plain(prompt)
    else:
        chat = {k: v for k, v in body.items() if k != "return_token_strs"}
        chat.setdefault("model", SERVED_MODEL)
        ids = list(converter.count_prompt(CHAT, chat, identity))
    out = {"count": len(ids), "max_model_len": converter.max_context, "tokens": ids}
    if strs:
        out["token_strs"] = [converter.token_text(t) for t in ids]
    return out


def detokenize(converter: Converter, body: dict) -> dict:
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field for /detokenize", param=unknown[0])
    if body.get("model") is not None:
        converter.resolve_model(body["model"], anthropic=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ApiError(400, "tokens: expected an array of token ids (integers)", param="tokens")
    vocab = converter.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is not a token id; ids are in [0, {vocab})", param="tokens")
    return {"prompt": converter.decode(tokens)}


def count_tokens(converter: Converter, body: dict, identity: str) -> dict:
    """Anthropic's count_tokens: the Messages request's input tokens (no `max_tokens` needed)."""
    return {"input_tokens": len(converter.count_prompt(MESSAGES, body, identity))}
