"""A small client for the ced.v1 API, and the `ced-jax client ADDR --prompt ...` command.

`stream` yields GenerateResponse messages as they arrive; leaving the loop early closes the channel,
which cancels the call, and the server then frees the request's slot and pages. `astream` is the
grpc.aio equivalent for concurrent clients (benchmarks, tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from serving.proto import ced_pb2, ced_pb2_grpc

FINISH_NAMES = {
    ced_pb2.FINISH_REASON_UNSPECIFIED: None,
    ced_pb2.FINISH_REASON_STOP: "stop",
    ced_pb2.FINISH_REASON_LENGTH: "length",
    ced_pb2.FINISH_REASON_ABORT: "abort",
}


def build_request(
    prompt: str | Sequence[int],
    *,
    request_id: str = "",
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    logprobs: int = 0,
    ignore_eos: bool = False,
) -> ced_pb2.GenerateRequest:
    """A GenerateRequest; a str prompt is sent as text, a sequence of ints as token ids."""
    sampling = ced_pb2.SamplingParams(top_k=top_k)
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    req = ced_pb2.GenerateRequest(
        request_id=request_id,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        logprobs=logprobs,
        ignore_eos=ignore_eos,
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(int(t) for t in prompt)
    return req


def stream(
    addr: str, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs
) -> Iterator[ced_pb2.GenerateResponse]:
    """Streams one completion from the server at `addr` ("host:port"); kwargs as in build_request."""
    req = build_request(prompt, **kwargs)
    with grpc.insecure_channel(addr) as channel:
        yield from ced_pb2_grpc.InferenceServiceStub(channel).Generate(req, timeout=timeout)


async def astream(
    addr: str, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs
) -> AsyncIterator[ced_pb2.GenerateResponse]:
    req = build_request(prompt, **kwargs)
    async with grpc.aio.insecure_channel(addr) as channel:
        async for msg in ced_pb2_grpc.InferenceServiceStub(channel).Generate(req, timeout=timeout):
            yield msg


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: ced_pb2.Usage | None
    logprobs: list[ced_pb2.TokenLogprobs]
    messages: int


def collect(messages) -> Completion:
    """Concatenates a stream of GenerateResponse messages."""
    out = Completion([], "", None, None, [], 0)
    for msg in messages:
        out.messages += 1
        out.token_ids.extend(msg.token_ids)
        out.text += msg.text
        out.logprobs.extend(msg.logprobs)
        if msg.finish_reason != ced_pb2.FINISH_REASON_UNSPECIFIED:
            out.finish_reason = FINISH_NAMES[msg.finish_reason]
            out.usage = msg.usage
    return out


def generate(addr: str, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs) -> Completion:
    return collect(stream(addr, prompt, timeout=timeout, **kwargs))


def _unary(addr: str, method: str, request, timeout: float | None):
    with grpc.insecure_channel(addr) as channel:
        return getattr(ced_pb2_grpc.InferenceServiceStub(channel), method)(request, timeout=timeout)


def tokenize(addr: str, text: str, timeout: float | None = 10.0) -> list[int]:
    return list(_unary(addr, "Tokenize", ced_pb2.TokenizeRequest(text=text), timeout).token_ids)


def model_info(addr: str, timeout: float | None = 10.0) -> ced_pb2.ModelInfo:
    return _unary(addr, "GetModelInfo", ced_pb2.GetModelInfoRequest(), timeout)


def abort(addr: str, request_id: str, timeout: float | None = 10.0) -> bool:
    return _unary(addr, "Abort", ced_pb2.AbortRequest(request_id=request_id), timeout).found


def main(argv: Sequence[str] | None = None) -> int:
    """`ced-jax client ADDR --prompt TEXT`: prints the text as it streams, a summary on stderr."""
    p = argparse.ArgumentParser(
        prog="ced-jax client", description="Stream a completion from a ced-jax server."
    )
    p.add_argument("addr", help="host:port of the server")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=0, help="0 = server default")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--logprobs", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float)
    a = p.parse_args(argv)
    kwargs = dict(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        stop=a.stop,
        logprobs=a.logprobs,
        ignore_eos=a.ignore_eos,
    )
    try:
        finish, usage = None, None
        for msg in stream(a.addr, a.prompt, timeout=a.timeout, **kwargs):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            if msg.finish_reason != ced_pb2.FINISH_REASON_UNSPECIFIED:
                finish, usage = FINISH_NAMES[msg.finish_reason], msg.usage
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    print(
        f"finish_reason={finish} prompt_tokens={usage.prompt_tokens} "
        f"cached_prompt_tokens={usage.cached_prompt_tokens} completion_tokens={usage.completion_tokens}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
