"""One HTTP request's generation: engine events -> deepseek-recipe's stream processor -> API objects.

The engine streams token ids (`StreamEvent.token_ids`; stop tokens are never sent). They go to
deepseek-recipe's `StreamProcessor` as `InferenceChunk.tokens` (it decodes them with the model's
tokenizer.json, splits `<think>` reasoning from the answer, parses DSML tool calls, applies JSON-mode
cleanup and stop strings) and come out as the API's own chunks / events. Stop strings are the
processor's: when it reports `finished` the engine request is aborted at once (closing the stream).
Closing the iterator early (client disconnect, cancel) also aborts the request, so no slot leaks.

The processor's `ready` chunk carries the prompt usage, including prefix-cache hits, which the
scheduler knows once the request has been admitted; it is pushed on the first engine event (which
comes after prefill), so every usage object reports the real `prompt_cache_hit_tokens`.

FIM (`/completions`) does not go through deepseek-recipe (it has no completions format): text comes
from the scheduler (which also applies the stop strings) and is wrapped in `text_completion` objects.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

import deepseek_recipe as d

from serving.errors import AdmissionError, InvalidRequest
from serving.http.convert import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Prepared
from serving.http.errors import ApiError
from serving.requests import FinishReason, GenerationRequest, Usage
from serving.scheduling.scheduler import Scheduler

RESPONSE_CLASS = {
    CHAT: d.ChatCompletionResponse,
    RESPONSES: d.ResponsesResponse,
    MESSAGES: d.MessagesResponse,
}
_REQUEST_CLASS = {CHAT: d.ChatCompletionRequest, RESPONSES: d.ResponsesRequest, MESSAGES: d.MessagesRequest}
_ADMISSION_STATUS = {"queue_full": 429, "duplicate_id": 409, "shutting_down": 503, "engine_failed": 503}
RETRY_AFTER_S = "1"


@dataclasses.dataclass
class Outcome:
    """Filled while a generation runs: what accounting and metrics need at the end."""

    usage: Usage | None = None
    finish: FinishReason | None = None
    sent_tokens: int = 0  # FIM: tokens whose text was sent (a stop token is counted by the engine only)
    reasoning_tokens: int = 0  # generated tokens before `</think>` (all of them while it has not come)
    in_reasoning: bool = False  # generation is (still) inside the reasoning

    def count(self, token_ids, think_end: int) -> None:
        if not self.in_reasoning:
            return
        for t in token_ids:
            if t == think_end:
                self.in_reasoning = False
                return
            self.reasoning_tokens += 1


def response_id(api: str) -> str:
    prefix = {CHAT: "chatcmpl-", COMPLETIONS: "cmpl-", RESPONSES: "resp_", MESSAGES: "msg_"}[api]
    return prefix + uuid.uuid4().hex


def submit(scheduler: Scheduler, p: Prepared, request_id: str, identity: str):
    """Submits `p` to the scheduler; admission and validation failures as ApiErrors."""
    # Image spans only when there are any, so a text request does not depend on the field.
    images = {"images": p.images} if p.images else {}
    req = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=p.prompt_ids,
        max_tokens=p.max_tokens,
        sampling=p.sampling,
        stop=p.stop,
        logprobs=p.logprobs,
        identity=identity,
        constraint=p.constraint,
        prefill_mode=p.prefill_mode,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids,
        **images,
    )
    try:
        return scheduler.submit_async(req)
    except InvalidRequest as e:
        raise ApiError(400, str(e), param=e.field) from None
    except AdmissionError as e:
        status = _ADMISSION_STATUS.get(e.kind, 503)
        headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else {}
        raise ApiError(status, str(e), headers=headers) from None


def _cached_tokens(stream) -> int:
    """Prompt tokens the prefix cache supplied to this request (known from its admission on).

    The scheduler reports them only in the final usage, but the API objects carry prompt usage from
    their first chunk; the request's scheduler record (the submit handle) holds the number once the
    request is admitted, which it is by the time its first event arrives.
    """
    return int(getattr(stream._handle, "cached_tokens", 0))


def _logprobs(ev, top: int):
    """deepseek-recipe's per-token (logprob, [(id, logprob), ...]) pairs for an event's tokens."""
    if not ev.logprobs or len(ev.logprobs) != len(ev.token_ids):
        return None
    return [(lp.logprob, list(lp.top[:top])) for lp in ev.logprobs]


async def chunks(
    scheduler: Scheduler,
    p: Prepared,
    tokenizer: d.Tokenizer,
    think_end: int,
    rid: str,
    identity: str,
    outcome: Outcome,
    hidden: frozenset[int] = frozenset(),
) -> AsyncIterator[list]:
    """deepseek-recipe chunk objects (Chat chunks / Responses events / Messages events), a list per step.
    `hidden`: special token ids that are not shown (Converter.hidden_special_ids); they still count
    in usage."""
    gen = _REQUEST_CLASS[p.api].chunk_generator(p.conv, rid, p.model.requested)
    if p.api == RESPONSES:
        if p.echo is not None:
            gen = gen.with_echo(p.echo)
        if p.namespace_map:
            gen = gen.with_namespace_tool_map(p.namespace_map)
    po = p.conv.parsing_options
    proc = d.StreamProcessor(gen, po, tokenizer=tokenizer)
    stage = po.thinking_initial_stage
    outcome.in_reasoning = stage is not None and stage.starts_in_reasoning() and not po.starts_in_tool_calls
    stream = submit(scheduler, p, rid, identity)
    try:
        started = False
        async for ev in stream:
            if ev.error is not None and ev.error_field is not None:  # the request's content
                raise ApiError(400, ev.error, param=ev.error_field)
            if ev.error is not None:
                raise ApiError(500, f"engine failure: {ev.error}")
            out = []
            if not started:
                started = True
                usage = d.PromptUsage(
                    prompt_tokens=len(p.prompt_ids), prompt_cache_hit_tokens=_cached_tokens(stream)
                )
                out += proc.push(d.InferenceChunk.ready(prompt_usage=usage))
            outcome.count(ev.token_ids, think_end)
            if ev.token_ids and not proc.finished:
                ids = list(ev.token_ids)
                lps = _logprobs(ev, p.logprobs) if p.want_logprobs else None
                if hidden and not hidden.isdisjoint(ids):  # never spelled out in a text field
                    keep = [i for i, t in enumerate(ids) if t not in hidden]
                    ids, lps = [ids[i] for i in keep], None if lps is None else [lps[i] for i in keep]
                if ids:
                    out += proc.push(d.InferenceChunk.tokens(ids, lps))
            if ev.final:
                outcome.usage, outcome.finish = ev.usage, ev.finish_reason
            if proc.finished:  # a stop string matched: the rest of the engine's output is not wanted
                out += proc.finish()
                if outcome.usage is None:
                    stream.close()  # aborts the engine request now
                yield out
                return
            if ev.final:
                reason = (
                    d.InferenceFinishReason.Length
                    if ev.finish_reason is FinishReason.LENGTH
                    else d.InferenceFinishReason.Stop
                )
                out += proc.push(d.InferenceChunk.finish(reason))
                out += proc.finish()
            if out:
                yield out
    finally:
        stream.close()  # a no-op once finished; otherwise aborts (client gone, error, stop string)
        proc.close()


def sse(api: str, chunk, outcome: Outcome | None = None) -> str:
    """One chunk as an SSE message in its API's wire format (`event:` lines where the API has them)."""
    name = RESPONSE_CLASS[api].sse_event_name(chunk)
    data = chunk.to_json()
    if outcome is not None and outcome.usage is not None and '"usage"' in data:
        data = json.dumps(patch_usage(api, json.loads(data), outcome), ensure_ascii=False)
    return (f"event: {name}\n" if name else "") + f"data: {data}\n\n"


def patch_usage(api: str, obj: dict, outcome: Outcome) -> dict:
    """Sets the output token counts of an API object's usage to the engine's.

    deepseek-recipe counts the tokens it decoded text from (and, fed token ids, miscounts reasoning
    tokens: more than were generated); the engine counts every token it generated (an incomplete UTF-8
    sequence at the end and the stop token included), which is what the request cost, so usage and the
    cost ledger agree. Reasoning tokens are the generated tokens before `</think>`, counted here. Prompt
    counts are ours already (the `ready` chunk).
    """
    usage = outcome.usage
    holder = obj.get("response") if api == RESPONSES and isinstance(obj.get("response"), dict) else obj
    u = holder.get("usage")
    if not isinstance(u, dict):
        return obj
    n = usage.completion_tokens
    if api == CHAT:
        u["completion_tokens"] = n
        u["total_tokens"] = u.get("prompt_tokens", 0) + n
        # OpenAI's field for output tokens a prediction supplied: here the DSpark drafts the target
        # accepted (0 without --dspark).
        u["completion_tokens_details"] = {
            "reasoning_tokens": outcome.reasoning_tokens,
            "accepted_prediction_tokens": usage.accepted_draft_tokens,
        }
    elif api == RESPONSES:
        u["output_tokens"] = n
        u["total_tokens"] = u.get("input_tokens", 0) + n
        u["output_tokens_details"] = {"reasoning_tokens": outcome.reasoning_tokens}
    elif api == MESSAGES and (obj.get("type") in ("message", "message_delta")):
        u["output_tokens"] = n
    return obj


def without_cut_tool_use(api: str, obj: dict) -> dict:
    """A Messages answer cut by max_tokens inside a tool call: its last `tool_use` block holds the
    unfinished call with `input: {}` (deepseek-recipe cannot parse part of one), which a client could
    run as if the model had asked for it. The block is dropped; `stop_reason: max_tokens` says why."""
    content = obj.get("content")
    if (
        api == MESSAGES
        and obj.get("stop_reason") == "max_tokens"
        and content
        and content[-1].get("type") == "tool_use"
    ):
        obj["content"] = content[:-1]
    return obj


def sse_done(api: str) -> str:
    done = RESPONSE_CLASS[api].sse_done_data()
    return f"data: {done}\n\n" if done is not None else ""


def sse_error(api: str, err: ApiError) -> str:
    """An error after the stream started, as each SDK recognizes one (it raises on it)."""
    if api == MESSAGES:
        return f"event: error\ndata: {json.dumps(err.anthropic_body())}\n\n"
    if api == RESPONSES:
        body = {"type": "error", "code": err.openai_body()["error"]["code"], "message": err.message}
        return f"event: error\ndata: {json.dumps(body)}\n\n"
    return f"data: {json.dumps(err.openai_body())}\n\n"


def new_response(api: str, rid: str, model: str, prompt_tokens: int, cached: int):
    return RESPONSE_CLASS[api](rid, model, int(time.time()), prompt_tokens, cached)


# ---- FIM -----------------------------------------------------------------------------------------

_FIM_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "stop"}


def fim_usage(prompt_tokens: int, cached: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": prompt_tokens - cached,
    }


class CompletionLogprobs:
    """The legacy completions `logprobs` object, grown token by token: `tokens`, `token_logprobs`,
    `top_logprobs` (one {token text: logprob} per token, `top` alternatives) and `text_offset` (where each
    token's text starts in the choice's text, counted from the echoed prompt's end)."""

    def __init__(self, token_text, top: int, start: int):
        self._text, self._top, self._offset = token_text, top, start

    def take(self, events_logprobs) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in events_logprobs:
            text = self._text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(
                {self._text(t): v for t, v in lp.top[: self._top]} if self._top else {}
            )
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out


async def completion_objects(
    scheduler: Scheduler, p: Prepared, rid: str, identity: str, outcome: Outcome, token_text
) -> AsyncIterator[dict]:
    """`text_completion` objects: one per engine event with text, the last with finish_reason + usage.
    `token_text(id)`: a token's text, for `logprobs`."""
    created = int(time.time())
    stream = submit(scheduler, p, rid, identity)
    logprobs = CompletionLogprobs(token_text, p.top_logprobs, len(p.fim_echo)) if p.want_logprobs else None

    def obj(text: str, finish: str | None, usage: dict | None, ev=None) -> dict:
        lps = None
        if logprobs is not None:
            lps = logprobs.take(ev.logprobs if ev is not None else ())
        o = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": p.model.requested,
            "system_fingerprint": None,
            "choices": [{"text": text, "index": 0, "logprobs": lps, "finish_reason": finish}],
        }
        if usage is not None or p.include_usage:
            o["usage"] = usage
        return o

    try:
        if p.fim_echo:
            yield obj(p.fim_echo, None, None)
        async for ev in stream:
            if ev.error is not None and ev.error_field is not None:  # the request's content
                raise ApiError(400, ev.error, param=ev.error_field)
            if ev.error is not None:
                raise ApiError(500, f"engine failure: {ev.error}")
            if ev.final:
                outcome.usage, outcome.finish = ev.usage, ev.finish_reason
                u = ev.usage
                # completion_tokens: the tokens the client got text for (the stop token is not one).
                outcome.sent_tokens += len(ev.token_ids)
                usage = fim_usage(u.prompt_tokens, u.cached_prompt_tokens, outcome.sent_tokens)
                yield obj(ev.text, _FIM_FINISH[ev.finish_reason], usage, ev)
                return
            outcome.sent_tokens += len(ev.token_ids)
            if ev.text or (logprobs is not None and ev.logprobs):
                yield obj(ev.text, None, None, ev)
    finally:
        stream.close()
