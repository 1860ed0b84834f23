"""A small client for the ced.v1 API, and the `ced-jax client ADDR --prompt ...` command.

`stream` yields GenerateResponse messages as they arrive; leaving the loop early closes the channel,
which cancels the call, and the server then frees the request's slot and pages. `astream` is the
grpc.aio equivalent for concurrent clients (benchmarks, tests).

Every call takes `api_key` (sent as `authorization: Bearer <key>`, the metadata OpenAI SDKs send) for
servers started with API keys; `user` names the end user on servers without keys (see ced.proto).

Images (a model with a vision tower): `images` in build_request, each the encoded bytes or a Files API id,
with one placeholder `IMAGE_PLACEHOLDER` per image in the text prompt; `ced-jax client --image FILE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from ced_jax.options import PREFILL_MODES
from serving.cli_help import DefaultsHelp
from serving.proto import ced_pb2, ced_pb2_grpc

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # ced_jax.vision's; not imported, so the client needs no JAX

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
    user: str = "",
    constraint: ced_pb2.OutputConstraint | None = None,
    images: Sequence[bytes | str] = (),
    prefill_mode: str | None = None,
) -> ced_pb2.GenerateRequest:
    """A GenerateRequest; a str prompt is sent as text, a sequence of ints as token ids. `constraint`:
    constrained decoding (JSON Schema, JSON object, regex or DSML tool calls; see ced.proto). `images`:
    each an encoded image (bytes) or a Files API file id (str), for the text prompt's placeholders.
    `prefill_mode`: "exact" or "ced" (None: the server's --prefill-mode)."""
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
        user=user,
        constraint=constraint,
        prefill_mode={None: 0, "exact": ced_pb2.PREFILL_MODE_EXACT, "ced": ced_pb2.PREFILL_MODE_CED}[
            prefill_mode
        ],
    )
    for image in images:
        if isinstance(image, str):
            req.images.add(file_id=image)
        elif isinstance(image, (bytes, bytearray, memoryview)):
            req.images.add(data=bytes(image))
        else:
            raise TypeError(f"images: expected bytes or a file id (str), got {type(image).__name__}")
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(int(t) for t in prompt)
    return req


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying `api_key` (None: no metadata)."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


def stream(
    addr: str,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    api_key: str | None = None,
    **kwargs,
) -> Iterator[ced_pb2.GenerateResponse]:
    """Streams one completion from the server at `addr` ("host:port"); kwargs as in build_request."""
    req = build_request(prompt, **kwargs)
    with grpc.insecure_channel(addr) as channel:
        yield from ced_pb2_grpc.InferenceServiceStub(channel).Generate(
            req, timeout=timeout, metadata=auth_metadata(api_key)
        )


async def astream(
    addr: str,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    api_key: str | None = None,
    **kwargs,
) -> AsyncIterator[ced_pb2.GenerateResponse]:
    req = build_request(prompt, **kwargs)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = ced_pb2_grpc.InferenceServiceStub(channel)
        async for msg in stub.Generate(req, timeout=timeout, metadata=auth_metadata(api_key)):
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


def _unary(addr: str, method: str, request, timeout: float | None, api_key: str | None):
    with grpc.insecure_channel(addr) as channel:
        call = getattr(ced_pb2_grpc.InferenceServiceStub(channel), method)
        return call(request, timeout=timeout, metadata=auth_metadata(api_key))


def tokenize(addr: str, text: str, timeout: float | None = 10.0, *, api_key: str | None = None) -> list[int]:
    return list(_unary(addr, "Tokenize", ced_pb2.TokenizeRequest(text=text), timeout, api_key).token_ids)


def model_info(addr: str, timeout: float | None = 10.0, *, api_key: str | None = None) -> ced_pb2.ModelInfo:
    return _unary(addr, "GetModelInfo", ced_pb2.GetModelInfoRequest(), timeout, api_key)


def abort(
    addr: str, request_id: str, timeout: float | None = 10.0, *, user: str = "", api_key: str | None = None
) -> bool:
    """Aborts the caller's own request `request_id` (the identity is `api_key`'s, else `user`)."""
    req = ced_pb2.AbortRequest(request_id=request_id, user=user)
    return _unary(addr, "Abort", req, timeout, api_key).found


INT32_MAX = 2**31 - 1  # the proto's int32 fields
UINT32_MAX = 2**32 - 1  # GenerateRequest.seed


def _int_in(low: int, high: int):
    """An argparse type: an integer in [low, high] (the proto field's range: beyond it the request
    could not be encoded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


def _address(text: str) -> str:
    """host:port, the port in [1, 65535]: gRPC takes a larger number modulo 65536 without a word."""
    if text.startswith("unix:") or "://" in text:  # other gRPC target forms are passed on as given
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    if not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [1, 65535], got {port}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """`ced-jax client`'s options."""
    p = argparse.ArgumentParser(
        prog="ced-jax client",
        description="Stream a completion from a ced-jax server.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("addr", type=_address, help="host:port of the server")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=_int_in(0, INT32_MAX), default=0, help="0 = server default")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=_int_in(0, INT32_MAX), default=0)
    p.add_argument("--seed", type=_int_in(0, UINT32_MAX))
    p.add_argument("--stop", action="append", default=[])
    p.add_argument(
        "--logprobs",
        type=_int_in(0, INT32_MAX),
        default=0,
        help="print each token's log-probability and this many alternatives (id:logprob) on stderr",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float)
    p.add_argument("--user", default="", help="end user the request is for (the identity without API keys)")
    p.add_argument("--api-key", help="sent as 'authorization: Bearer KEY' (servers with --api-key-file)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help=f"an image file for a vision model (repeatable, in order); the prompt holds one "
        f"{IMAGE_PLACEHOLDER} per image, or none and they are put before it",
    )
    p.add_argument(
        "--image-file-id",
        action="append",
        default=[],
        metavar="ID",
        help="an image uploaded to the server's Files API (repeatable; after the --image files)",
    )
    p.add_argument(
        "--prefill-mode", choices=PREFILL_MODES, help="how the prompt is prefilled (default: the server's)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", help="constrain the output to JSON matching this JSON Schema (JSON text)")
    g.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    g.add_argument("--regex", help="constrain the output to match this regular expression")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`ced-jax client ADDR --prompt TEXT`: prints the text as it streams, a summary on stderr."""
    p = build_parser()
    a = p.parse_args(argv)
    images: list[bytes | str] = []
    for path in a.image:
        try:
            with open(path, "rb") as f:
                images.append(f.read())
        except OSError as e:
            p.error(f"--image {path}: {e.strerror}")
    images.extend(a.image_file_id)
    prompt = a.prompt
    if images and IMAGE_PLACEHOLDER not in prompt:
        prompt = IMAGE_PLACEHOLDER * len(images) + prompt
    constraint = None
    if a.json_schema is not None:
        constraint = ced_pb2.OutputConstraint(json_schema=a.json_schema)
    elif a.json_object:
        constraint = ced_pb2.OutputConstraint(json_object=True)
    elif a.regex is not None:
        constraint = ced_pb2.OutputConstraint(regex=a.regex)
    kwargs = dict(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        stop=a.stop,
        logprobs=a.logprobs,
        ignore_eos=a.ignore_eos,
        user=a.user,
        constraint=constraint,
        images=images,
        prefill_mode=a.prefill_mode,
    )
    try:
        finish, usage, logprobs = None, None, []
        for msg in stream(a.addr, prompt, timeout=a.timeout, api_key=a.api_key, **kwargs):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            logprobs.extend(msg.logprobs)
            if msg.finish_reason != ced_pb2.FINISH_REASON_UNSPECIFIED:
                finish, usage = FINISH_NAMES[msg.finish_reason], msg.usage
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    for i, lp in enumerate(logprobs):  # --logprobs N: one line per generated token, on stderr
        top = " ".join(f"{t.token_id}:{t.logprob:.6g}" for t in lp.top)
        print(f"logprobs[{i}] token={lp.token_id} logprob={lp.logprob:.6g} top={top}", file=sys.stderr)
    print(
        f"finish_reason={finish} prompt_tokens={usage.prompt_tokens} "
        f"cached_prompt_tokens={usage.cached_prompt_tokens} completion_tokens={usage.completion_tokens}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
