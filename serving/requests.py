"""What a request is and what comes back: `GenerationRequest` (from the gRPC and HTTP front ends to the
scheduler) and the `StreamEvent`s its sink receives, with their finish reasons and usage."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from serving.constraints import OutputConstraint
from serving.engine.protocol import SamplingParams
from serving.vision import RequestImage


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None = None  # None = ServeConfig.default_max_tokens
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    deadline: float | None = None  # in the scheduler's clock (time.monotonic)
    identity: str = ""  # the tenant: namespaces request_id and scopes the prefix cache ("" = anonymous)
    constraint: OutputConstraint | None = None  # what the output may be (constrained decoding)
    # Image spans of the prompt (serving.vision.RequestImage, ascending, disjoint): the prompt holds
    # the image token id at every span position; the spans' rows go to the model with the tokens.
    images: tuple[RequestImage, ...] = ()
    # How the prompt is prefilled ("exact" or "ced", ced_jax.options.PREFILL_MODES); None = the server's
    # ServeConfig.prefill_mode.
    prefill_mode: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    accepted_draft_tokens: int = 0  # DSpark drafts the target accepted (included in completion_tokens)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None  # the engine failed; the stream ends without a finish reason
    # With `error`: the request field whose content could not be served (a constraint whose grammar
    # failed mid-stream): the client's mistake, not the engine's. None: the engine failed.
    error_field: str | None = None
    deadline_exceeded: bool = False  # with finish_reason ABORT: the request's deadline passed

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


Sink = Callable[[StreamEvent], None]
