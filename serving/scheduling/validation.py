"""The checks a request passes before it is queued (`Scheduler.validate`): every field against the
serve config's limits and the engine's shapes, its image spans against the prompt, and its output
constraint (compiled). A failure is an `InvalidRequest` naming the field."""

from __future__ import annotations

import numpy as np

from ced_jax.options import PREFILL_MODES
from serving.config import ServeConfig
from serving.constraints import ConstraintError, ConstraintMatcher, ConstraintTokenizer, OutputConstraint
from serving.engine.protocol import EngineSpec
from serving.errors import InvalidRequest
from serving.requests import GenerationRequest
from serving.vision import RequestImage


def check_request(req: GenerationRequest, cfg: ServeConfig, spec: EngineSpec) -> int:
    """Raises InvalidRequest naming the field or limit; returns the effective max_tokens (what the
    request may generate within max_context)."""
    if not req.request_id or len(req.request_id) > cfg.max_request_id_length:
        raise InvalidRequest("request_id", f"must have 1..{cfg.max_request_id_length} characters")
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt", "is empty")
    if n >= spec.max_context:
        raise InvalidRequest(
            "prompt",
            f"has {n} tokens; the limit is max_context - 1 = {spec.max_context - 1} (max_context = "
            f"{spec.max_context} tokens of prompt plus output; ced-jax serve --max-context)",
        )
    ids = np.asarray(req.prompt_token_ids)
    if ids.min() < 0 or ids.max() >= spec.vocab_size:
        raise InvalidRequest("prompt_token_ids", f"token ids must be in [0, {spec.vocab_size})")
    if req.max_tokens is not None:
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be >= 1, got {req.max_tokens}")
        if req.max_tokens > cfg.max_tokens_limit:
            raise InvalidRequest(
                "max_tokens",
                f"{req.max_tokens} exceeds the limit max_tokens = {cfg.max_tokens_limit} "
                "(--max-tokens-limit)",
            )
    if not 0 <= req.logprobs <= cfg.max_logprobs:
        raise InvalidRequest(
            "logprobs", f"must be in 0..max_logprobs = {cfg.max_logprobs}, got {req.logprobs}"
        )
    if len(req.stop) > cfg.max_stop_strings:
        raise InvalidRequest("stop", f"at most max_stop_strings = {cfg.max_stop_strings} strings")
    for s in req.stop:
        if not s or len(s) > cfg.max_stop_string_length:
            raise InvalidRequest(
                "stop", f"each stop string must have 1..{cfg.max_stop_string_length} characters"
            )
    if any(not 0 <= t < spec.vocab_size for t in req.stop_token_ids):
        raise InvalidRequest("stop_token_ids", f"token ids must be in [0, {spec.vocab_size})")
    if req.images:
        check_images(req, ids, spec)
    if req.prefill_mode is not None:
        if req.prefill_mode not in PREFILL_MODES:
            raise InvalidRequest(
                "prefill_mode", f"must be one of {list(PREFILL_MODES)}, got {req.prefill_mode!r}"
            )
        if req.prefill_mode == "ced" and not spec.ced_window:
            raise InvalidRequest("prefill_mode", "'ced': this model has no CED layout (exact only)")
    max_tokens = cfg.default_max_tokens if req.max_tokens is None else req.max_tokens
    # The sequence (prompt + output) must fit in max_context; beyond it finish with LENGTH.
    return min(max_tokens, spec.max_context - n)


def constraint_matcher(
    req: GenerationRequest, constraint_tokenizer: ConstraintTokenizer | None, unavailable: str = ""
) -> ConstraintMatcher | None:
    """The grammar matcher of the request's `constraint` (compiling it is its check), None without one.
    unavailable: why there is no `constraint_tokenizer`, for the refusal's message."""
    if req.constraint is None:
        return None
    if not isinstance(req.constraint, OutputConstraint):
        raise InvalidRequest("constraint", "must be a serving.constraints.OutputConstraint")
    if constraint_tokenizer is None:
        raise InvalidRequest(
            "constraint", f"this server cannot enforce output constraints: no tokenizer.json{unavailable}"
        )
    try:
        return constraint_tokenizer.matcher(req.constraint)
    except ConstraintError as e:
        raise InvalidRequest(f"constraint.{e.field}", e.message) from None


def check_images(req: GenerationRequest, ids: np.ndarray, spec: EngineSpec) -> None:
    """Raises InvalidRequest naming the image and field whose span does not fit the prompt."""
    if not spec.hidden_size:
        raise InvalidRequest("images", "this model has no vision tower: it takes no images")
    end = 0
    for i, im in enumerate(req.images):
        field = f"images[{i}]"
        if not isinstance(im, RequestImage):
            raise InvalidRequest(field, "must be a serving.vision.RequestImage")
        types = np.asarray(im.token_types)
        rows = np.asarray(im.span_embeds)
        if types.ndim != 1 or len(types) < 3 or not np.issubdtype(types.dtype, np.integer):
            raise InvalidRequest(f"{field}.token_types", "must be a 1-D integer array of at least 3 types")
        if types.min() < 0 or types.max() > 3 or types[0] != 0 or types[-1] != 3:
            raise InvalidRequest(
                f"{field}.token_types",
                "values must be 0..3 (START, IMAGE, NEWLINE, END), from a START to an END",
            )
        if rows.shape != (len(types), spec.hidden_size) or rows.dtype != np.float32:
            raise InvalidRequest(
                f"{field}.span_embeds",
                f"expected float32 {[len(types), spec.hidden_size]}, got {rows.dtype} {list(rows.shape)}",
            )
        if not isinstance(im.content_hash, bytes) or len(im.content_hash) != 32:
            raise InvalidRequest(f"{field}.content_hash", "must be the 32-byte SHA-256 of the pixels")
        if im.start < end:
            raise InvalidRequest(f"{field}.start", "spans must be ascending and disjoint")
        if im.end > len(ids):
            raise InvalidRequest(f"{field}.start", f"span [{im.start}, {im.end}) runs past the prompt")
        if np.any(ids[im.start : im.end] != spec.image_token_id):
            raise InvalidRequest(
                f"{field}.start",
                f"every span position must hold the image token id {spec.image_token_id}",
            )
        end = im.end
