"""HTTP request bodies -> engine requests: validation, model names, thinking, the prompt, limits.

One `Prepared` per request, built off the event loop (deepseek-recipe's conversion is synchronous Rust):
- The body is parsed here (bad JSON, a non-object, a wrong type: 400 naming the field; never a 500).
- The model name is resolved against the served name and its aliases (unknown: 404).
- Thinking and effort are resolved by the chat layer (`ced_jax.chat.resolve_thinking`: hosted effort
  names, integers 1-100, and the seeds' `thinking: {"type": "enabled", "effort": ...}`), then the body
  is normalized so deepseek-recipe (which ignores `thinking.effort` and rejects integer efforts) converts
  it to the same mode; the effort number goes to our renderer directly.
- deepseek-recipe converts and validates the request (Chat Completions / Responses / Messages), giving
  the conversation, sampling options (per-mode temperature / top_p rules), parsing options (stop strings,
  tool-call and JSON parsing) and the output constraint. Its ConversionError is the hosted API's answer.
- The prompt is rendered and encoded ONLY by our chat layer (`ced_jax.chat`, through `serving.chat`;
  exact to DeepSeek's reference encoder; deepseek-recipe's own renderer differs from it in a few cases).
- Images (serving/http/images.py): image parts of every form are found and rewritten before conversion,
  resolved to bytes after rendering (base64, a leased Files API file, an allowed URL), and expanded into
  their token spans by the engine's image pipeline (`ImagePipeline.build_prompt`), so `prompt_ids` and the
  usage count each image as its span length. A model without a vision tower answers 400.
- FIM (`/completions`) is built here: `BOS <fim_begin> prompt <fim_hole> suffix <fim_end>` (api-surface
  §16.7), non-thinking only.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

import deepseek_recipe as d

from ced_jax.chat import ChatFormatError, PromptEncoder, resolve_thinking
from ced_jax.options import PREFILL_MODES
from serving.chat import render_conversation
from serving.constraints import OutputConstraint
from serving.engine.protocol import SamplingParams
from serving.http import structured
from serving.http.errors import ApiError, from_conversion_error
from serving.http.fields import CHAT, COMPLETIONS, MESSAGES, RESPONSES, check_fields
from serving.http.images import ImageResolver, extract_images, index_of
from serving.json_limits import MAX_NESTING, nesting_depth
from serving.model_names import SERVED_MODEL, ModelCatalog, Resolved, UnknownModel

FIM_MAX_TOKENS = 4096  # the hosted FIM limit (api-surface §10)
# Named in every context-length error: the server's limit, which an operator can raise.
CONTEXT_FLAG = " (this server's limit: ced-jax serve --max-context)"
PLAIN_DEFAULT_MAX_TOKENS = 16  # a plain completion's default, as OpenAI's legacy route and vLLM's
MAX_TOKENS_UPPER = 393216  # the hosted max_tokens range is [1, 393216]
SEED_MODULUS = 2**32  # the engine's seed is uint32
_SPECIAL = d.SpecialTokens(image="<｜deepseek_image｜>")  # V4.1 spelling of the image placeholder
_PARSED_SPECIALS = ("<think>", "</think>", "｜DSML｜")  # what deepseek-recipe's stream parser reads
_EFFORT_NAMES = {"none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything the generation driver needs for one request."""

    api: str
    model: Resolved  # the requested name (echoed), what it means (serving/model_names.py)
    stream: bool
    include_usage: bool
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    logprobs: int  # top alternatives per token (0: none)
    want_logprobs: bool
    thinking: bool
    effort: int | None
    identity_hint: str  # the body's user / user_id / metadata.user_id (identity without API keys)
    conv: Any = None  # deepseek-recipe ConversationRequest (chat, responses, messages)
    echo: Any = None  # ResponsesEcho
    namespace_map: dict | None = None  # Responses namespace tools
    stop: tuple[str, ...] = ()  # FIM only: chat-style routes leave stop strings to deepseek-recipe
    fim_echo: str = ""  # FIM `echo: true`: the prompt, returned before the completion
    constraint: OutputConstraint | None = None  # enforced by the engine (serving/constraints.py)
    images: tuple = ()  # the image spans for GenerationRequest.images (serving/vision.py RequestImage)
    leases: tuple = ()  # Files API leases held while the request runs (serving/files.py); see release()
    prefill_mode: str | None = None  # the body's `prefill_mode` extension ("exact" / "ced"); None: server's
    ignore_eos: bool = False  # the body's `ignore_eos` extension (as vLLM's): through EOS to max_tokens
    stop_token_ids: tuple[int, ...] = ()  # the body's `stop_token_ids` extension
    top_logprobs: int = 0  # completions: alternatives shown per token (`logprobs` asks the engine >= 1)
    identity_field: str = "user"  # where identity_hint came from (named in the over-long error)

    def release(self) -> None:
        """Gives back the request's file leases (idempotent); the app calls it when the request ends."""
        for lease in self.leases:
            lease.release()


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body; 400 naming the problem otherwise."""
    if not raw:
        raise ApiError(400, "request body: is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "request body: is not UTF-8 text") from None
    except ValueError as e:
        raise ApiError(400, f"request body: invalid JSON ({e})") from None
    except RecursionError:
        body = None  # nested past Python's own limit: certainly past ours
    depth = nesting_depth(body) if body is not None else MAX_NESTING + 1
    if depth > MAX_NESTING:
        raise ApiError(400, f"request body: nested deeper than {MAX_NESTING} levels")
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**64:
        raise ApiError(400, f"seed: must be in [0, 2^64), got {seed}", param="seed")
    return body


def body_field(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] if absent/None or of `kinds` (bool is not a number), else 400 naming the field."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds:
        raise ApiError(400, f"{name}: expected {what}, got a boolean", param=name)
    if not isinstance(v, kinds):
        raise ApiError(400, f"{name}: expected {what}, got {type(v).__name__}", param=name)
    return v


@dataclasses.dataclass(frozen=True)
class Extensions:
    """Fields the hosted API does not have (serving/http/fields.py), taken out of the body so the API
    converters never see them."""

    prefill_mode: str | None = None  # "exact" / "ced"; None: the server's --prefill-mode
    ignore_eos: bool = False  # vLLM's: generate through EOS to max_tokens
    top_k: int = 0  # 0: off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # Responses / Messages (deepseek-recipe reads chat's own `seed`)


def _extensions(api: str, body: dict) -> Extensions:
    mode = body_field(body, "prefill_mode", (str,), "a string")
    if mode is not None and mode not in PREFILL_MODES:
        raise ApiError(
            400, f"prefill_mode: must be one of {list(PREFILL_MODES)}, got {mode!r}", param="prefill_mode"
        )
    ignore_eos = bool(body_field(body, "ignore_eos", (bool,), "a boolean"))
    top_k = body_field(body, "top_k", (int,), "an integer") or 0
    if top_k < 0:
        raise ApiError(400, f"top_k: must be >= 0 (0: off), got {top_k}", param="top_k")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(type(t) is int and t >= 0 for t in stop_ids)
    ):
        raise ApiError(
            400, "stop_token_ids: expected an array of token ids (integers >= 0)", param="stop_token_ids"
        )
    seed = None
    if api in (RESPONSES, MESSAGES):
        seed = body_field(body, "seed", (int,), "an integer")
        if seed is not None and not 0 <= seed < 2**64:
            raise ApiError(400, f"seed: must be in [0, 2^64), got {seed}", param="seed")
        body.pop("seed", None)
    for name in ("prefill_mode", "ignore_eos", "top_k", "stop_token_ids"):
        body.pop(name, None)
    return Extensions(mode, ignore_eos, top_k, tuple(stop_ids or ()), seed)


def _max_completion_tokens(body: dict) -> None:
    """Chat's `max_completion_tokens` (the OpenAI SDK's current name) folded into `max_tokens`, which
    deepseek-recipe reads: the smaller of the two when both are given."""
    value = body_field(body, "max_completion_tokens", (int,), "an integer")
    body.pop("max_completion_tokens", None)
    if value is None:
        return
    if not 1 <= value <= MAX_TOKENS_UPPER:
        raise ApiError(
            400,
            "max_completion_tokens: Invalid max_completion_tokens value, the valid range of "
            f"max_completion_tokens is [1, {MAX_TOKENS_UPPER}]",
            param="max_completion_tokens",
        )
    given = body.get("max_tokens")
    body["max_tokens"] = value if not isinstance(given, int) or isinstance(given, bool) else min(given, value)


class Converter:
    """Builds `Prepared` requests for one served model (tokenizer, context size, limits)."""

    def __init__(
        self,
        hf_tokenizer,
        *,
        catalog: ModelCatalog,
        max_context: int,
        max_tokens_limit: int,
        max_logprobs: int,
        images=None,
        resolver: ImageResolver | None = None,
        max_prompt_bytes: int | None = None,
    ):
        """`images`: the engine's ImagePipeline (serving/vision.py), None for a model without a vision tower;
        `resolver`: turns image references into bytes (the server's file store and URL fetcher);
        `max_prompt_bytes`: the rendered prompt's UTF-8 bytes, checked before it is tokenized (None: no
        limit), as gRPC's GenerateRequest.prompt."""
        self.max_prompt_bytes = max_prompt_bytes
        # The most input bytes one token can stand for: its spelling's UTF-8 bytes (a byte-level or
        # SentencePiece spelling is never shorter than what it covers), x4 for normalizers that
        # shorten text (NFKC: a 3-byte fullwidth letter to 1 byte). A prompt of n bytes is at least
        # n / this many tokens, known before tokenizing it.
        longest = max(len(t.encode("utf-8")) for t in hf_tokenizer.get_vocab(with_added_tokens=True))
        self._bytes_per_token_bound = 4 * max(1, longest)
        self.encoder = PromptEncoder(hf_tokenizer)
        self.images = images
        self.resolver = resolver
        self._hf = hf_tokenizer
        self.max_context = max_context
        self.max_tokens_limit = max_tokens_limit
        self.max_logprobs = max_logprobs
        self.catalog = catalog
        opts = d.ConversionOptions().with_special_tokens(_SPECIAL)
        # deepseek-recipe sees every request as `deepseek-flash` (names are resolved before it).
        self._opts = opts.with_model_alias(SERVED_MODEL, d.ModelVersion.DeepseekV41Flash)

        def special(name: str) -> int:
            tid = hf_tokenizer.token_to_id(name)
            if tid is None:
                raise ValueError(f"tokenizer: has no special token {name}")
            return tid

        # Special tokens a random or confused model may emit that no text field shows (the stream
        # parser reads only the thinking and tool-call markers, which stay).
        self.hidden_special_ids = frozenset(
            i for i, t in hf_tokenizer.get_added_tokens_decoder().items()
            if t.special and t.content not in _PARSED_SPECIALS
        )  # fmt: skip
        self.bos_id = special("<｜begin▁of▁sentence｜>")
        self.think_end_id = special("</think>")
        self._fim = [special("<｜fim▁begin｜>"), special("<｜fim▁hole｜>"), special("<｜fim▁end｜>")]

    # ---- model names -------------------------------------------------------------------------
    def resolve_model(self, name: Any, anthropic: bool) -> Resolved:
        """The served model for `name` (counted per name); 404 in the API's format for an unknown one."""
        try:
            return self.catalog.resolve(name, "anthropic" if anthropic else "openai")
        except UnknownModel as e:
            raise ApiError(e.status, f"model: {e.message}", param=e.param, code=e.code) from None

    # ---- entry point -------------------------------------------------------------------------
    def prepare(self, api: str, raw: bytes, identity: str = "") -> Prepared:
        """The request's `Prepared`; `identity` scopes Files API ids (the API key's name, "" without keys).
        The caller must `release()` the result when the request ends (it may hold file leases)."""
        body = parse_body(raw)
        check_fields(api, body)
        if api == COMPLETIONS:
            return self._prepare_completion(body, COMPLETIONS)
        if api == CHAT and body.get("fim") is not None:
            return self._prepare_completion(_fim_body(body), CHAT)
        leases: list = []
        try:
            p = self._prepare_chat(api, body, identity, leases)
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        return dataclasses.replace(p, leases=tuple(leases))

    def count_prompt(self, api: str, body: dict, identity: str = "") -> tuple[int, ...]:
        """The prompt ids a chat-style request (`body`, parsed) would be served with (image spans
        expanded), validated as `prepare` validates it, without the output limits."""
        check_fields(api, body)
        leases: list = []
        try:
            return self._prepare_chat(api, body, identity, leases, count_only=True)
        finally:
            for lease in leases:
                lease.release()

    # ---- chat-style APIs ---------------------------------------------------------------------
    def _thinking_fields(self, api: str, body: dict) -> tuple[Any, Any, str]:
        """(thinking object, effort value, the effort field's name) as the API spells them."""
        if api == CHAT:
            return body.get("thinking"), body.get("reasoning_effort"), "reasoning_effort"
        if api == MESSAGES:
            oc = body.get("output_config")
            effort = oc.get("effort") if isinstance(oc, dict) else None
            return body.get("thinking"), effort, "output_config.effort"
        r = body.get("reasoning")
        effort = r.get("effort") if isinstance(r, dict) else None
        return None, effort, "reasoning.effort"

    def _normalize_thinking(self, api: str, body: dict, model: Resolved) -> tuple[bool, int | None]:
        """Resolves thinking + effort (chat layer) and rewrites the body so deepseek-recipe agrees."""
        thinking_obj, effort, effort_field = self._thinking_fields(api, body)
        if thinking_obj is not None and not isinstance(thinking_obj, dict):
            raise ApiError(400, 'thinking: expected an object such as {"type": "enabled"}', param="thinking")
        if thinking_obj is None and model.thinking_override is not None:
            thinking_obj = {"type": "enabled" if model.thinking_override else "disabled"}
        try:
            thinking, budget = resolve_thinking(thinking_obj, effort, default_thinking=model.default_thinking)
        except ChatFormatError as e:
            raise ApiError(400, str(e), param=effort_field.split(".")[0]) from None
        seed_effort = thinking_obj.get("effort") if isinstance(thinking_obj, dict) else None
        # deepseek-recipe: a string effort it knows stays (it picks the max_tokens default from it);
        # an integer (a local extension) is removed; the seeds' thinking.effort is copied over.
        name = effort if isinstance(effort, str) else seed_effort if effort is None else None
        name = name if isinstance(name, str) and name in _EFFORT_NAMES else None
        if api == RESPONSES:
            r = dict(body.get("reasoning") or {})
            r.pop("effort", None)
            if not thinking:
                r["effort"] = "none"
            elif name is not None and name != "none":
                r["effort"] = name
            body["reasoning"] = r
            return thinking, budget
        t = {"type": "enabled" if thinking else "disabled"}
        body["thinking"] = t
        if api == CHAT:
            body.pop("reasoning_effort", None)
            if thinking and name is not None and name != "none":
                body["reasoning_effort"] = name
        else:
            oc = dict(body.get("output_config") or {})
            oc.pop("effort", None)
            if thinking and name is not None and name != "none":
                oc["effort"] = name
            body["output_config"] = oc
        return thinking, budget

    def _prepare_chat(
        self, api: str, body: dict, identity_scope: str, leases: list, count_only: bool = False
    ):
        model = self.resolve_model(body.get("model"), anthropic=api == MESSAGES)
        stream = body_field(body, "stream", (bool,), "a boolean") or False
        n = body_field(body, "n", (int,), "an integer")
        if n is not None and n != 1:
            raise ApiError(400, "n: Invalid n value (currently only n = 1 is supported)", param="n")
        if api == RESPONSES and body.get("previous_response_id") is not None:
            raise ApiError(
                400,
                "previous_response_id: not supported (this server stores no responses); send the whole "
                "conversation in `input`",
                param="previous_response_id",
            )
        thinking, effort = self._normalize_thinking(api, body, model)
        ext = _extensions(api, body)
        if api == CHAT:
            _max_completion_tokens(body)
        refs = extract_images(api, body)  # rewrites image parts in `body` before conversion
        if refs:
            if self.images is None:
                raise ApiError(
                    400,
                    f"{refs[0].field}: this model has no vision input (its checkpoint has no vision tower); "
                    "send text only",
                    param=refs[0].field,
                )
            self.resolver.precheck(refs)
        identity, identity_field = _identity_hint(api, body)
        include_usage = False
        so = body.get("stream_options")
        if isinstance(so, dict) and so.get("include_usage") is True:
            include_usage = True
        body["model"] = SERVED_MODEL
        forced = structured.forced_tools(api, body, thinking)
        cls = {CHAT: d.ChatCompletionRequest, RESPONSES: d.ResponsesRequest, MESSAGES: d.MessagesRequest}[api]
        echo = ns_map = None
        try:
            req = cls(body)
            if api == RESPONSES:
                echo = req.echo()
                ns_map = req.namespace_tool_map(self._opts)
                req = cls(body)  # echo() leaves it usable, but be independent of that detail
            conv = req.convert(self._opts)
        except d.ConversionError as e:
            raise from_conversion_error(e.status_code, e.body) from None
        except ValueError as e:  # serde: bad JSON types; name the field deepseek-recipe did not
            raise ApiError(400, _blame(cls, body, self._opts, str(e)), param=None) from None
        conversation = conv.conversation
        last = conversation.messages[-1] if conversation.messages else None
        if last is not None and last.prefix and conversation.thinking_mode:
            raise ApiError(
                400,
                "messages[-1].prefix: chat prefix completion is supported in non-thinking mode only; send "
                '"thinking": {"type": "disabled"}',
                param="thinking",
            )
        try:
            rendered = render_conversation(conversation, effort=effort)
        except ChatFormatError as e:
            raise ApiError(400, str(e)) from None
        self.check_prompt_bytes("input" if api == RESPONSES else "messages", rendered.prompt)
        ids, spans = self._prompt_ids(api, rendered, refs, identity_scope, leases)
        if count_only:
            return tuple(ids)
        io = conv.inference_options
        max_tokens = self._max_tokens(conv, len(ids), io.max_tokens, api)
        logprobs = 0
        if io.logprobs:
            logprobs = max(1, io.top_logprobs or 0)
            if logprobs > self.max_logprobs:
                raise ApiError(
                    400,
                    f"top_logprobs: {logprobs} exceeds this server's limit {self.max_logprobs}",
                    param="top_logprobs",
                )
        seed = io.seed if ext.seed is None else ext.seed
        sampling = _sampling(io.temperature, io.top_p, seed, ext.top_k)
        return Prepared(
            api=api,
            model=model,
            stream=bool(stream),
            include_usage=include_usage,
            prompt_ids=tuple(ids),
            max_tokens=max_tokens,
            sampling=sampling,
            logprobs=logprobs,
            want_logprobs=bool(io.logprobs),
            thinking=conversation.thinking_mode,
            effort=effort,
            identity_hint=identity,
            identity_field=identity_field,
            conv=conv,
            echo=echo,
            namespace_map=ns_map,
            constraint=structured.output_constraint(
                io.output_constraint, conversation.thinking_mode, body, api, self.think_end_id, forced
            ),
            prefill_mode=ext.prefill_mode,
            ignore_eos=ext.ignore_eos,
            stop_token_ids=ext.stop_token_ids,
            images=spans,
        )

    def _prompt_ids(self, api: str, rendered, refs: list, identity: str, leases: list):
        """(prompt ids, image spans): the encoded prompt, each image placeholder expanded to its span."""
        if not rendered.images:
            return self.encoder.encode(rendered), ()
        order = [index_of(getattr(src, "url", None)) for src in rendered.images]
        if any(i is None or i >= len(refs) for i in order):
            raise ApiError(400, "messages: an image in a form this server does not read", param="messages")
        data = self.resolver.resolve([refs[i] for i in order], identity, leases)

        def encode(text: str) -> list[int]:
            # The pipeline tokenizes the rendered prompt; ours keeps client text apart from special tokens.
            if text != rendered.prompt:
                # A contract breach, not a client error: a RuntimeError (500), never a 400.
                raise RuntimeError("the image pipeline must encode the rendered prompt as given")
            return self.encoder.encode(rendered)

        field = "input" if api == RESPONSES else "messages"
        # The pipeline names image i `images[i]` (in prompt order); an error there is answered naming
        # the request field that image came from.
        fields = {f"images[{n}]": refs[i].field for n, i in enumerate(order)}
        try:
            ids, spans = self.images.build_prompt(rendered.prompt, data, encode, field="images")
        except ValueError as e:  # serving.vision.ImageInputError (and the pre-processing's ImageError)
            where = fields.get(getattr(e, "field", None), field)
            message = str(getattr(e, "message", None) or e)
            message = message.removeprefix(f"{getattr(e, 'field', None)}: ")
            if not message.startswith(where):
                message = f"{where}: {message}"
            raise ApiError(400, message, param=where) from None
        return tuple(int(t) for t in ids), tuple(spans)

    def _max_tokens(self, conv, prompt_tokens: int, requested: int | None, api: str) -> int:
        """The hosted defaults (8192 / 65536 / 131072) and range, lowered to the context left; a
        requested value beyond the server's limit or the context is refused naming the field."""
        field = {RESPONSES: "max_output_tokens"}.get(api, "max_tokens")
        if prompt_tokens >= self.max_context:
            raise ApiError(
                400,
                f"messages: This model's maximum context length is {self.max_context} tokens. However, "
                f"your messages resulted in {prompt_tokens} tokens. "
                "Please reduce the length of the messages." + CONTEXT_FLAG,
                param="messages",
            )
        try:
            resolved = conv.resolve_max_tokens(prompt_tokens, self.max_context)
        except d.ConversionError as e:
            err = from_conversion_error(e.status_code, e.body)
            hint = CONTEXT_FLAG if "context length" in err.message else ""
            raise ApiError(err.status, f"{field}: {err.message}{hint}", param=field) from None
        if requested is not None and requested > self.max_tokens_limit:
            raise ApiError(
                400,
                f"{field}: {requested} exceeds this server's limit of {self.max_tokens_limit} output tokens "
                "(ced-jax serve --max-tokens-limit)",
                param=field,
            )
        return max(1, min(resolved, self.max_tokens_limit, self.max_context - prompt_tokens))

    def check_prompt_bytes(self, field: str, text: str) -> None:
        """400 before tokenizing a prompt over `max_prompt_bytes`, or one certainly longer than the
        context (tokenizing a megabyte takes a core for a second; gRPC refuses such a prompt the same
        way)."""
        limit = self.max_prompt_bytes
        if limit is not None and len(text) > limit // 4 and len(text.encode("utf-8")) > limit:
            n = len(text.encode("utf-8"))
            raise ApiError(
                400, f"{field}: the prompt has {n} bytes of UTF-8; the limit is max_prompt_bytes = {limit} "
                "(--max-prompt-bytes)", param=field,
            )  # fmt: skip
        if len(text) > self.max_context:  # else it cannot be certainly too long: no need to count bytes
            at_least = -(-len(text.encode("utf-8")) // self._bytes_per_token_bound)
            if at_least >= self.max_context:
                raise ApiError(
                    400,
                    f"{field}: This model's maximum context length is {self.max_context} tokens. However, "
                    f"your {field} resulted in at least {at_least} tokens. Please reduce their length."
                    + CONTEXT_FLAG,
                    param=field,
                )

    # ---- completions: plain or fill-in-the-middle ----------------------------------------------------
    def _prepare_completion(self, body: dict, api: str) -> Prepared:
        """`/completions`: a plain text completion of `prompt`, or FIM when `suffix` is given (the hosted
        beta route's layout, api-surface §10). `api` CHAT: the seeds' `fim` probe on the chat route,
        answered as a chat completion."""
        model = self.resolve_model(body.get("model"), anthropic=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        where = "fim.prompt" if api == CHAT else "prompt"
        if not isinstance(prompt, str):
            raise ApiError(400, f"{where}: is required (a string)", param=where)
        suffix = body_field(body, "suffix", (str,), "a string")
        fim = suffix is not None or api == CHAT
        self.check_prompt_bytes(where, prompt + (suffix or ""))
        ext = _extensions(COMPLETIONS, body)
        thinking_obj = body.get("thinking")
        wants_thinking = model.thinking_override is True
        if thinking_obj is not None:
            if not isinstance(thinking_obj, dict):
                raise ApiError(400, "thinking: expected an object", param="thinking")
            wants_thinking = thinking_obj.get("type") in ("enabled", "adaptive")
        effort = body.get("reasoning_effort")
        if effort is not None and effort != "none":
            wants_thinking = True
        # The chat route thinks by default: its `fim` probe must turn thinking off, as the seeds' does.
        off = thinking_obj is not None and thinking_obj.get("type") == "disabled"
        off = off or effort == "none" or model.thinking_override is False
        if wants_thinking or (api == CHAT and not off):
            what = "FIM completion" if fim else "Text completion"
            raise ApiError(
                400,
                f"thinking: {what} is supported in non-thinking mode only; "
                + ("omit thinking or " if api != CHAT else "")
                + 'send "thinking": {"type": "disabled"}',
                param="thinking",
            )
        n = body_field(body, "n", (int,), "an integer")
        if n is not None and n != 1:
            raise ApiError(400, "n: Invalid n value (currently only n = 1 is supported)", param="n")
        stream = body_field(body, "stream", (bool,), "a boolean") or False
        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and so.get("include_usage") is True
        upper = FIM_MAX_TOKENS if fim else MAX_TOKENS_UPPER
        max_tokens = body_field(body, "max_tokens", (int,), "an integer")
        if max_tokens is not None and not 1 <= max_tokens <= upper:
            raise ApiError(
                400,
                f"max_tokens: Invalid max_tokens value, the valid range of max_tokens is [1, {upper}]"
                + (" for FIM completion" if fim else ""),
                param="max_tokens",
            )
        temperature = body_field(body, "temperature", (int, float), "a number")
        if temperature is not None and not 0 <= temperature <= 2:
            raise ApiError(
                400,
                "temperature: Invalid temperature value, the valid range of temperature is [0, 2]",
                param="temperature",
            )
        top_p = body_field(body, "top_p", (int, float), "a number")
        if top_p is not None and not 0 < top_p <= 1:
            raise ApiError(
                400, "top_p: Invalid top_p value, the valid range of top_p is (0, 1]", param="top_p"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = body_field(body, name, (int, float), "a number")
            if value is not None and not -2 <= value <= 2:
                raise ApiError(
                    400, f"{name}: Invalid {name} value, the valid range of {name} is [-2, 2]", param=name
                )
        seed = body_field(body, "seed", (int,), "an integer")
        stops = _stops(body.get("stop"))
        if api == CHAT:
            logprobs = None
            if body_field(body, "logprobs", (bool,), "a boolean"):
                logprobs = body_field(body, "top_logprobs", (int,), "an integer") or 0
        else:
            logprobs = body_field(body, "logprobs", (int,), "an integer")
        top = min(20, self.max_logprobs)
        if logprobs is not None and not 0 <= logprobs <= top:
            field = "top_logprobs" if api == CHAT else "logprobs"
            raise ApiError(400, f"{field}: must be in [0, {top}], got {logprobs}", param=field)
        echo = body_field(body, "echo", (bool,), "a boolean") or False
        if echo and logprobs is not None:
            raise ApiError(
                400,
                "echo: with logprobs it would need the prompt's log-probabilities, which are not computed; "
                "send one of them",
                param="echo",
            )
        if fim:
            b, hole_begin, hole, hole_end = self.bos_id, *self._fim
            ids = [
                b,
                hole_begin,
                *self.encoder.plain(prompt),
                hole,
                *self.encoder.plain(suffix or ""),
                hole_end,
            ]
        else:
            ids = [self.bos_id, *self.encoder.plain(prompt)]
        if len(ids) >= self.max_context:
            raise ApiError(
                400,
                f"{where}: This model's maximum context length is {self.max_context} tokens. However, your "
                f"prompt{' and suffix' if fim else ''} resulted in {len(ids)} tokens. Please reduce "
                f"{'their' if fim else 'its'} length." + CONTEXT_FLAG,
                param=where,
            )
        if max_tokens is not None and max_tokens > self.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens: {max_tokens} exceeds this server's limit of {self.max_tokens_limit} "
                "output tokens (ced-jax serve --max-tokens-limit)",
                param="max_tokens",
            )
        # Defaults: the hosted FIM limit; a plain completion's is OpenAI's (and vLLM's): 16 tokens.
        limit = max_tokens if max_tokens is not None else FIM_MAX_TOKENS if fim else PLAIN_DEFAULT_MAX_TOKENS
        max_tokens = max(1, min(limit, self.max_tokens_limit, self.max_context - len(ids)))
        conv = None
        if api == CHAT:  # deepseek-recipe shapes the chat answer (non-thinking text, stop strings)
            chat = {
                "model": SERVED_MODEL, "messages": [{"role": "user", "content": "-"}], "stop": list(stops),
                "thinking": {"type": "disabled"}, "max_tokens": max_tokens,
            }  # fmt: skip
            conv = d.ChatCompletionRequest(chat).convert(self._opts)
            stops = ()
        user = body.get("user_id", body.get("user"))
        return Prepared(
            api=api,
            model=model,
            stream=bool(stream),
            include_usage=include_usage,
            prompt_ids=tuple(ids),
            max_tokens=max_tokens,
            sampling=_sampling(1.0 if temperature is None else temperature, top_p, seed, ext.top_k),
            logprobs=0 if logprobs is None else max(1, logprobs),
            want_logprobs=logprobs is not None,
            thinking=False,
            effort=None,
            identity_hint=user if isinstance(user, str) else "",
            identity_field="user_id" if "user_id" in body else "user",
            conv=conv,
            stop=stops,
            fim_echo=prompt if echo else "",
            prefill_mode=ext.prefill_mode,
            ignore_eos=ext.ignore_eos,
            stop_token_ids=ext.stop_token_ids,
            top_logprobs=logprobs or 0,
        )

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def decode(self, token_ids) -> str:
        return self._hf.decode([int(t) for t in token_ids], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text, as completions' `logprobs.tokens` show it (special tokens spelled out)."""
        return self._hf.decode([int(token_id)], skip_special_tokens=False)


def _fim_body(body: dict) -> dict:
    """The seeds' `{"fim": {"prompt", "suffix"}}` chat body as a completions body (api-surface §10)."""
    fim = body.get("fim")
    if not isinstance(fim, dict):
        raise ApiError(400, 'fim: expected an object {"prompt": ..., "suffix": ...}', param="fim")
    if body.get("messages") is not None:
        raise ApiError(400, "fim: send either `fim` or `messages`, not both", param="fim")
    for name in ("tools", "tool_choice", "response_format", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise ApiError(
                400, f"{name}: not with `fim` (a fill-in-the-middle completion is plain text)", param=name
            )
    unknown = sorted(set(fim) - {"prompt", "suffix"})
    if unknown:
        raise ApiError(400, f"fim.{unknown[0]}: unknown field; fim takes prompt and suffix", param="fim")
    suffix = fim.get("suffix", "")
    if not isinstance(suffix, str):
        raise ApiError(400, "fim.suffix: expected a string", param="fim")
    out = {k: v for k, v in body.items() if k != "fim"}
    if "max_completion_tokens" in out:
        _max_completion_tokens(out)
    return {**out, "prompt": fim.get("prompt"), "suffix": suffix}


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "stop: expected a string or an array of strings", param="stop")
    if len(stops) > 16:
        raise ApiError(400, f"stop: Stop string array too long: {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop: stop strings must not be empty", param="stop")
    return stops


def _sampling(
    temperature: float | None, top_p: float | None, seed: int | None, top_k: int = 0
) -> SamplingParams:
    t = 1.0 if temperature is None else float(temperature)
    p = 1.0 if top_p is None or top_p <= 0 else min(1.0, float(top_p))
    s = secrets.randbits(32) if seed is None else int(seed) % SEED_MODULUS
    return SamplingParams(temperature=t, top_p=p, top_k=int(top_k), seed=s)


def _identity_hint(api: str, body: dict) -> tuple[str, str]:
    """The end-user id a request names and its field (hosted `user_id`; Anthropic `metadata.user_id`;
    else `user`)."""
    if api == MESSAGES:
        md = body.get("metadata")
        v, field = (md.get("user_id") if isinstance(md, dict) else None), "metadata.user_id"
    else:
        field = "user_id" if "user_id" in body else "user"
        v = body.get(field)
    return (v if isinstance(v, str) else ""), field


def _blame(cls, body: dict, opts, message: str) -> str:
    """deepseek-recipe's serde message ("invalid type: string, expected f32") names no field: find a
    top-level field whose removal changes that outcome, and name it. By halves, so a body of n fields
    costs about log2(n) conversions, not n."""
    detail = message.removeprefix("invalid request body: ").removeprefix("invalid JSON request: ")

    def same_error_without(keys: list[str]) -> bool:
        removed = set(keys)
        trial = {k: v for k, v in body.items() if k not in removed}
        try:
            cls(trial).convert(opts)
        except ValueError as e:
            return str(e) == message
        except Exception:  # noqa: BLE001 - any other outcome means a removed field was the culprit
            return False
        return False

    candidates = [k for k in body if k != "model"]
    if not candidates or same_error_without(candidates):
        return f"request body: {detail}"
    while len(candidates) > 1:
        half = candidates[: len(candidates) // 2]
        candidates = candidates[len(half) :] if same_error_without(half) else half
    return f"{candidates[0]}: {detail}"
