"""The gRPC front end: translates ced.v1 messages to scheduler calls and back, nothing more.

Request flow: `Generate` validates the proto fields (INVALID_ARGUMENT naming the field), tokenizes a
text prompt off the event loop, and submits a `GenerationRequest`; the scheduler thread streams
`StreamEvent`s back through an asyncio queue and each becomes one `GenerateResponse`. If the client
cancels, disconnects or its deadline passes, grpc.aio cancels the handler; the `finally` closes the
stream, which aborts the request so its slot and pages are freed in the next scheduler step.

Start-up (`serve`): every port is bound first, so a busy one fails in seconds with one line, not after
the model has been loaded and compiled. The gRPC server then listens with health NOT_SERVING and
answers InferenceService calls UNAVAILABLE ("warming up") while the model loads and the engine warms
up; health turns SERVING when it is ready.

Shutdown (SIGTERM or SIGINT in `serve`): health turns NOT_SERVING and new Generate calls get
UNAVAILABLE; in-flight streams may finish for up to `grace_period_s` (a second signal ends the grace
period at once); whatever is still running is then aborted, so its stream ends normally with
finish_reason ABORT; the gRPC server stops and `serve` returns 0.

Multi-host (`serve_async(..., cluster=...)`, process 0 of a `serving.engine.multihost` run): once serving, a
`PeerWatch` follows the other processes' heartbeats; when one stops, `Server.lose_peer` logs a line
naming it, turns health NOT_SERVING, refuses new requests (UNAVAILABLE) and aborts those in flight.

Work before the scheduler runs on the server's `WorkPools` (serving/work_pools.py, shared with the
HTTP API): Generate's prompt tokenization and images on `prepare`, Tokenize on `tokenize`, each pool
bounded and shared fairly between tenants (the API key's name, else the peer's address); text sizes
are capped by `max_tokenize_bytes` / `max_prompt_bytes`.

Images (a model with a vision tower): `GenerateRequest.images`, each the encoded bytes or a Files API id
(the server's one FileStore, shared with the HTTP API; a lease holds the file for the request's duration),
go through the server's `ImagePipeline` (serving/vision.py: pre-processing, feature cache, ViT on a miss),
on a worker thread, before the request is submitted; each placeholder of the text prompt becomes its
image's span. Every problem with them is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import secrets
import signal
import socket
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.config import ServeConfig
from serving.constraints import constraint_from_proto
from serving.engine.protocol import EngineProtocol, SamplingParams
from serving.files import FileError, FileLease, FileStore
from serving.metrics import Metrics, MetricsServer
from serving.proto import ced_pb2, ced_pb2_grpc
from serving.requests import FinishReason, GenerationRequest, StreamEvent
from serving.scheduling.scheduler import AdmissionError, InvalidRequest, Scheduler
from serving.tenants import Unauthenticated, server_interceptors
from serving.text import Tokenizer
from serving.vision import ImageInputError, ImagePipeline
from serving.work_pools import PoolBusy, WorkPools, peer_tenant

log = logging.getLogger(__name__)

SERVICE_NAME = ced_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
_MAX_TEMPERATURE = 100.0
_PREFILL_MODES = {ced_pb2.PREFILL_MODE_EXACT: "exact", ced_pb2.PREFILL_MODE_CED: "ced"}
_ADMISSION_CODES = {
    "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "duplicate_id": grpc.StatusCode.ALREADY_EXISTS,
    "shutting_down": grpc.StatusCode.UNAVAILABLE,
    "engine_failed": grpc.StatusCode.UNAVAILABLE,
}
_FINISH = {
    None: ced_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: ced_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: ced_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: ced_pb2.FINISH_REASON_ABORT,
}


def _prefill_mode(value: int) -> str | None:
    """GenerateRequest.prefill_mode as the scheduler's mode (None: the server's default)."""
    if value == ced_pb2.PREFILL_MODE_UNSPECIFIED:
        return None
    if value not in _PREFILL_MODES:
        raise InvalidRequest("prefill_mode", f"unknown value {value}")
    return _PREFILL_MODES[value]


def sampling_from_proto(msg: ced_pb2.SamplingParams, has: bool) -> SamplingParams:
    """SamplingParams from the proto message, raising InvalidRequest naming a bad field."""
    temperature, top_p, top_k = 1.0, 1.0, 0
    seed = secrets.randbits(32)
    if has:
        if msg.HasField("temperature"):
            temperature = msg.temperature
            if not (math.isfinite(temperature) and 0.0 <= temperature <= _MAX_TEMPERATURE):
                raise InvalidRequest(
                    "sampling.temperature", f"must be in [0, {_MAX_TEMPERATURE}], got {temperature}"
                )
        if msg.HasField("top_p"):
            top_p = msg.top_p
            if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
                raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
        top_k = msg.top_k
        if top_k < 0:
            raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 = off), got {top_k}")
        if msg.HasField("seed"):
            seed = msg.seed
    return SamplingParams(
        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed)
    )


def event_to_proto(ev: StreamEvent) -> ced_pb2.GenerateResponse:
    out = ced_pb2.GenerateResponse(
        request_id=ev.request_id,
        token_ids=ev.token_ids,
        text=ev.text,
        finish_reason=_FINISH[ev.finish_reason],
    )
    for lp in ev.logprobs:
        entry = out.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for tid, tlp in lp.top:
            entry.top.add(token_id=tid, logprob=tlp)
    if ev.usage is not None:
        out.usage.CopyFrom(
            ced_pb2.Usage(
                prompt_tokens=ev.usage.prompt_tokens,
                cached_prompt_tokens=ev.usage.cached_prompt_tokens,
                completion_tokens=ev.usage.completion_tokens,
            )
        )
    return out


class InferenceServicer(ced_pb2_grpc.InferenceServiceServicer):
    """`images`: the model's ImagePipeline (None: the model takes no images); `files`: the Files API
    store that `ImageInput.file_id` names (None: file ids are refused)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        config: ServeConfig,
        *,
        images: ImagePipeline | None = None,
        files: FileStore | None = None,
        pools: WorkPools,
    ):
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._config = config
        self._images = images
        self._files = files
        self._pools = pools
        self.active_streams = 0

    def _tenant(self, context, identity: str | None) -> str:
        """Whom the work pools share between: the API key's name, else the peer's address."""
        if self._config.api_keys is not None and identity is not None:
            return identity
        return peer_tenant(context.peer())

    async def _encode(self, text: str, tenant: str) -> list[int]:
        """Generate's text prompt as token ids, on the `prepare` pool."""
        _check_text_size("prompt", text, "max_prompt_bytes", self._config.max_prompt_bytes)
        return await self._pools.prepare.run(tenant, self._tokenizer.encode, text)

    async def _identity(self, context, user: str) -> str:
        """The tenant a call acts for: its API key's name when keys are configured, else `user`.

        Raises InvalidRequest for an over-long `user`; aborts UNAUTHENTICATED without a valid key (the
        server's ApiKeyInterceptor refuses such calls first; this covers a servicer used without it).
        """
        limit = self._config.max_user_length
        if len(user) > limit:
            raise InvalidRequest(
                "user", f"has {len(user)} characters; the limit is max_user_length = {limit}"
            )
        keys = self._config.api_keys
        if keys is None:
            return user
        try:
            return keys.authenticate(context.invocation_metadata())
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    async def _to_request(
        self, request: ced_pb2.GenerateRequest, context, leases: list[FileLease]
    ) -> GenerationRequest:
        """The scheduler's request; Files API leases taken for its images are appended to `leases`
        (the caller releases them when the request ends)."""
        identity = await self._identity(context, request.user)
        tenant = self._tenant(context, identity)
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequest("prompt", "one of prompt or prompt_token_ids is required")
        images = ()
        if request.images:
            if which != "prompt":
                raise InvalidRequest(
                    "images", "need a text prompt holding their placeholders, not prompt_token_ids"
                )
            ids, images = await self._expand_images(request, identity, tenant, leases)
        elif which == "prompt":
            if not request.prompt:
                raise InvalidRequest("prompt", "is empty")
            ids = tuple(await self._encode(request.prompt, tenant))
        else:
            ids = tuple(request.prompt_token_ids.ids)
            if not ids:
                raise InvalidRequest("prompt_token_ids", "is empty")
        if request.max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be >= 0 (0 = server default), got {request.max_tokens}")
        if request.logprobs < 0:
            raise InvalidRequest("logprobs", f"must be >= 0, got {request.logprobs}")
        sampling = sampling_from_proto(request.sampling, request.HasField("sampling"))
        remaining = context.time_remaining()
        if remaining is None:
            remaining = self._config.default_deadline_s
        deadline = None if remaining is None else self._scheduler.clock() + remaining
        return GenerationRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=ids,
            max_tokens=request.max_tokens or None,
            sampling=sampling,
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            logprobs=request.logprobs,
            ignore_eos=request.ignore_eos,
            deadline=deadline,
            identity=identity,
            constraint=constraint_from_proto(request),
            images=images,
            prefill_mode=_prefill_mode(request.prefill_mode),
        )

    async def _expand_images(self, request, identity: str, tenant: str, leases: list[FileLease]):
        """(prompt ids with each image placeholder expanded into its span, the RequestImage spans)."""
        pipeline, count = self._images, len(request.images)
        if pipeline is None:
            raise InvalidRequest("images", "this model has no vision tower: it takes no images")
        limit = pipeline.max_images_per_request
        if count > limit:  # before any file is looked up or image decoded
            raise InvalidRequest(
                "images", f"{count} images in one request; the limit is {limit} (--max-images-per-request)"
            )
        _check_text_size("prompt", request.prompt, "max_prompt_bytes", self._config.max_prompt_bytes)
        blobs = []
        for i, image in enumerate(request.images):
            source = image.WhichOneof("source")
            if source == "data":
                blobs.append(image.data)
            elif source == "file_id":
                field = f"images[{i}].file_id"
                if self._files is None:
                    raise InvalidRequest(field, "this server has no Files API store")
                try:
                    lease = self._files.acquire(identity, image.file_id, field)
                except FileError as e:
                    raise InvalidRequest(field, e.message.removeprefix(f"{field}: ")) from None
                leases.append(lease)
                blobs.append(lease.data)
            else:
                raise InvalidRequest(f"images[{i}]", "one of data or file_id is required")
        try:
            # Pre-processing and, on a feature-cache miss, the ViT: seconds of work, off the event loop.
            ids, spans = await self._pools.prepare.run(
                tenant,
                functools.partial(pipeline.build_prompt, field="images"),
                request.prompt,
                blobs,
                self._tokenizer.encode,
            )
        except ImageInputError as e:
            field = e.field
            if field.startswith("images[") and field.endswith("]"):  # name which source was bad
                i = int(field[len("images[") : -1])
                field += "." + (request.images[i].WhichOneof("source") or "data")
            raise InvalidRequest(field, e.message) from None
        return tuple(ids), tuple(spans)

    async def Generate(self, request, context):
        self.active_streams += 1
        leases: list[FileLease] = []  # Files API images, held until the request ends
        try:
            try:
                req = await self._to_request(request, context, leases)
                stream = self._scheduler.submit_async(req)
            except InvalidRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except PoolBusy as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except AdmissionError as e:
                await context.abort(_ADMISSION_CODES[e.kind], str(e))
            try:
                async for ev in stream:
                    if ev.error is not None and ev.error_field is not None:  # the request's content
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, ev.error)
                    if ev.error is not None:
                        await context.abort(grpc.StatusCode.INTERNAL, f"engine failure: {ev.error}")
                    if ev.deadline_exceeded:
                        # The scheduler noticed the deadline before gRPC did; answer as gRPC would.
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    yield event_to_proto(ev)
            finally:
                stream.close()  # a no-op after the final event; otherwise aborts the request
        finally:
            for lease in leases:
                lease.release()
            self.active_streams -= 1

    async def Tokenize(self, request, context):
        try:
            _check_text_size("text", request.text, "max_tokenize_bytes", self._config.max_tokenize_bytes)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # On the Tokenize pool: its few threads bound how many Tokenize calls run at once, and calls
        # beyond them wait there, not on the pool Generate's prompts are tokenized on. The response
        # (up to a million ids) is built there too, off the event loop.
        keys = self._config.api_keys
        identity = None if keys is None else await self._identity(context, "")
        text, encode = request.text, self._tokenizer.encode
        try:
            return await self._pools.tokenize.run(
                self._tenant(context, identity), lambda: ced_pb2.TokenizeResponse(token_ids=encode(text))
            )
        except PoolBusy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def GetModelInfo(self, request, context):
        spec, cfg = self._scheduler.spec, self._config
        return ced_pb2.ModelInfo(
            model_name=spec.model_name,
            config={k: str(v) for k, v in spec.config_summary.items()},
            limits=ced_pb2.Limits(
                max_context=spec.max_context,
                max_tokens=cfg.max_tokens_limit,
                max_slots=spec.max_slots,
                max_running=cfg.running_limit,
                max_queued=cfg.max_queued,
                max_logprobs=cfg.max_logprobs,
                max_stop_strings=cfg.max_stop_strings,
                max_stop_string_length=cfg.max_stop_string_length,
                default_max_tokens=cfg.default_max_tokens,
                max_user_length=cfg.max_user_length,
                max_images_per_request=0 if self._images is None else cfg.max_images_per_request,
                max_image_bytes=0 if self._images is None else cfg.max_image_bytes,
            ),
            accepts_images=self._images is not None,
            vocab_size=spec.vocab_size,
            eos_token_ids=spec.eos_token_ids,
            page_size=spec.page_size,
            num_pages=spec.num_pages,
            prefill_buckets=spec.prefill_buckets,
        )

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: is empty")
        try:
            identity = await self._identity(context, request.user)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # Only the caller's own requests: another identity's request with this id is not found.
        found = self._scheduler.abort(request.request_id, identity=identity)
        return ced_pb2.AbortResponse(found=found)


def image_pipeline(
    engine: EngineProtocol, config: ServeConfig, metrics: Metrics | None = None
) -> ImagePipeline | None:
    """The ImagePipeline of `engine`'s model (serving.engine.jax_engine.JaxEngine keeps it as `.model`), with
    the config's cache size and image limits; None for a model without a vision tower (or an engine
    without a model, such as the mock).

    Its ViT programs are compiled by `warm_vision_encoder` (Server.attach, with the engine's warm-up)."""
    model = getattr(engine, "model", None)
    encoder = getattr(model, "vision", None)
    if encoder is None:
        return None
    return ImagePipeline(
        encoder,
        model.cfg.vision,
        image_token_id=model.cfg.image_token_id,
        feature_cache_bytes=config.feature_cache_bytes,
        max_images_per_request=config.max_images_per_request,
        max_image_bytes=config.max_image_bytes,
        metrics=metrics,
    )


# Synthetic pictures (width, height) for the ViT warm-up: thin ones give the fewest patches after the
# pre-processing's upscaling to min_pixels (tiny-v: 645 patches for 28x2000 against 1521 for a square).
_WARMUP_SIZES = ((28, 2000), (2000, 28), (14, 4000), (4000, 14), (64, 64))


def warm_vision_encoder(encoder, vcfg) -> tuple[int, ...]:
    """Compiles the ViT + aligner program of every patch bucket a picture can need, so no request pays
    a compile; returns the buckets compiled. A bucket below the fewest patches any of `_WARMUP_SIZES`
    gives is skipped (no real picture is expected there: pre-processing scales every picture up to
    `min_pixels`); should one come, it compiles on first use (tiny-v: about 2 s on CPU).
    The runs count in `encoder.runs`, not in the pipeline's counters or metrics."""
    from PIL import Image

    from ced_jax.vision import prepare_image

    smallest = min(
        (prepare_image(Image.new("RGB", size), vcfg) for size in _WARMUP_SIZES),
        key=lambda image: image.num_patches,
    )
    buckets = tuple(b for b in encoder.buckets if b >= smallest.num_patches)
    for bucket in buckets:
        encoder.features(smallest, bucket=bucket)
    return buckets


def _check_text_size(field: str, text: str, limit_name: str, limit: int) -> None:
    """Raises InvalidRequest naming `field` if `text` has more than `limit` bytes of UTF-8."""
    if 4 * len(text) <= limit:  # a character is 1..4 bytes: decided without encoding the text
        return
    size = len(text.encode("utf-8"))
    if size > limit:
        flag = "--" + limit_name.replace("_", "-")
        raise InvalidRequest(
            field, f"has {size} bytes of UTF-8; the limit is {limit_name} = {limit} ({flag})"
        )


# ---- request decoding -------------------------------------------------------------------------------
# grpc's usual request deserializer (`Message.FromString`) raises DecodeError when a proto3 `string`
# field holds invalid UTF-8 (a client that does not validate can send that), and grpc.aio answers any
# deserializer exception with UNKNOWN "Unexpected <class ...DecodeError>", naming no field. The fields
# stay `string` in ced.proto (they are text, and declaring them `bytes` would make every client encode
# and decode them); instead each method is registered with a deserializer that, on failure, hands the
# handler an `_UndecodableRequest`, and the handler answers INVALID_ARGUMENT. The field is found by
# parsing the same bytes as a twin message type whose string fields are bytes.


@dataclasses.dataclass(frozen=True)
class _UndecodableRequest:
    message: str  # the INVALID_ARGUMENT details, naming the field where one is to blame


@functools.cache
def _text_as_bytes_pool() -> tuple[descriptor_pool.DescriptorPool, str, str]:
    """A pool holding a copy of ced.proto in which every string field is bytes (map entries excepted:
    proto maps cannot have bytes keys, and no request has a map); with the original and copy packages."""
    proto = descriptor_pb2.FileDescriptorProto()
    ced_pb2.DESCRIPTOR.CopyToProto(proto)
    package, twin = proto.package, proto.package + ".text_as_bytes"
    proto.name = proto.name.removesuffix(".proto") + "_text_as_bytes.proto"
    proto.package = twin
    del proto.service[:]

    def convert(messages) -> None:
        for m in messages:
            convert(m.nested_type)
            for f in m.field:
                if f.type_name.startswith(f".{package}."):
                    f.type_name = f".{twin}." + f.type_name.removeprefix(f".{package}.")
                if f.type == FieldDescriptor.TYPE_STRING and not m.options.map_entry:
                    f.type = FieldDescriptor.TYPE_BYTES

    convert(proto.message_type)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool, package, twin


def _first_invalid_utf8(original: Descriptor, msg, prefix: str = "") -> str | None:
    """The path (`stop[1]`, `sampling.x`) of the first field of `msg`, a text-as-bytes twin of a
    message of type `original`, that is a string field there and not UTF-8 here."""
    for field, value in msg.ListFields():
        name = prefix + field.name
        values = value if field.is_repeated else [value]
        original_field = original.fields_by_name[field.name]
        for i, item in enumerate(values):
            path = f"{name}[{i}]" if field.is_repeated else name
            if field.message_type is not None and not field.message_type.GetOptions().map_entry:
                found = _first_invalid_utf8(original_field.message_type, item, path + ".")
                if found is not None:
                    return found
            elif original_field.type == FieldDescriptor.TYPE_STRING and isinstance(item, bytes):
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return path
    return None


def _explain_undecodable(descriptor: Descriptor, data: bytes, error: DecodeError) -> str:
    pool, package, twin = _text_as_bytes_pool()
    twin_class = message_factory.GetMessageClass(
        pool.FindMessageTypeByName(twin + descriptor.full_name.removeprefix(package))
    )
    try:
        field = _first_invalid_utf8(descriptor, twin_class.FromString(data))
    except DecodeError:
        field = None
    if field is None:
        return f"request: not a valid {descriptor.full_name} message ({error})"
    return f"{field}: is not valid UTF-8 (a proto3 string field must be)"


@dataclasses.dataclass(frozen=True)
class _OversizedRequest:
    message: str  # the RESOURCE_EXHAUSTED details: the method's limit and what sets it


_NOT_READY = object()  # a request before attach(): answered UNAVAILABLE without being parsed


def _deserializer(message_class, limit: Callable[[], int | None]) -> Callable[[bytes], object]:
    """Parses a request after checking its size against `limit()` (None: not serving yet)."""

    def deserialize(data: bytes):
        most = limit()
        if most is None:
            return _NOT_READY
        if len(data) > most:
            return _OversizedRequest(
                f"{message_class.DESCRIPTOR.name}: {len(data)} bytes; this method accepts at most {most} "
                "(the server's text limits, and images only on a model that takes them)"
            )
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return _UndecodableRequest(_explain_undecodable(message_class.DESCRIPTOR, data, e))

    return deserialize


# ---- listening ------------------------------------------------------------------------------------

_GRPC_DEFAULT_MAX_RECEIVE_BYTES = 4 << 20
_ROOM_FOR_OTHER_FIELDS_BYTES = 1 << 20  # stop strings, ids and the rest of a request beside its text


def _max_request_bytes(config: ServeConfig) -> int:
    """gRPC's receive limit: never below its default, and room for text at the configured limits (else
    gRPC would refuse a legal request first, with RESOURCE_EXHAUSTED naming no field)."""
    largest_text = max(config.max_prompt_bytes, config.max_tokenize_bytes)
    # A Generate request may also carry max_images_per_request images of max_image_bytes each (bound
    # before the model is loaded, so whether it takes images is not known yet).
    images = config.max_images_per_request * config.max_image_bytes
    return max(_GRPC_DEFAULT_MAX_RECEIVE_BYTES, largest_text + images + _ROOM_FOR_OTHER_FIELDS_BYTES)


def _host_port(host: str, port: int) -> str:
    """host:port as gRPC parses it (an IPv6 literal in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _http_url(host: str, port: int) -> str:
    return f"http://{_host_port(host, port)}"


class PortUnavailable(ValueError):
    """A port the server should listen on cannot be had; the message names the option that chose it."""


_Bound = TypeVar("_Bound")


def _listen(option: str, host: str, port: int, bind: Callable[[], _Bound]) -> _Bound:
    """`bind()` (which listens on host:port), or PortUnavailable naming `option` if that fails.

    The address is probed first with a plain socket (SO_REUSEADDR as servers set it, no SO_REUSEPORT):
    when gRPC itself fails to bind (a busy port, a host that is not local), its C core also logs
    several lines to stderr, and the probe answers first with one line. A port taken between probe and
    bind still fails, with gRPC's lines as well.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
        return bind()
    except (OSError, RuntimeError) as e:
        if isinstance(e, socket.gaierror):
            reason = e.strerror  # e.g. "Name or service not known" for a bad host
        elif isinstance(e, OSError) and e.errno:
            reason = os.strerror(e.errno)  # create_server's own text repeats the address
        else:
            reason = str(e)
        raise PortUnavailable(f"{option}: cannot listen on {_host_port(host, port)}: {reason}") from None


class Server:
    """gRPC (InferenceService, health, reflection) and metrics listeners, then an engine behind them.

    Two phases, so that a port that cannot be had fails in seconds, before the model is loaded and its
    programs compiled: `bind()` listens on every port (health NOT_SERVING; InferenceService calls get
    UNAVAILABLE "warming up"), `attach(engine, tokenizer)` warms the engine up, starts the scheduler and
    turns health SERVING. `start(engine, tokenizer)` does both.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = Metrics()
        # The Files API store: one per server, so a file uploaded over HTTP can be named in gRPC too.
        self.files = FileStore(config.http_files)
        # The pools that work before the scheduler, shared with the HTTP API the same way.
        self.pools = WorkPools.from_config(config)
        self.pools.export(self.metrics)
        self.images: ImagePipeline | None = None  # set by attach() for a model with a vision tower
        self.health = health.aio.HealthServicer()
        # Set by attach(); until then the InferenceService answers UNAVAILABLE.
        self.engine: EngineProtocol | None = None
        self.scheduler: Scheduler | None = None
        self.servicer: InferenceServicer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self.http = None  # serving.http.HttpFrontEnd when config.http_port is set
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._grace_over = asyncio.Event()
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return _host_port(self.config.host, self.port)

    async def bind(self) -> None:
        """Listens on every configured port; if one cannot be had, raises PortUnavailable (a ValueError
        naming its option) with nothing left listening. New ports go here, each through `_listen`."""
        cfg = self.config
        server = grpc.aio.server(
            interceptors=server_interceptors(cfg.api_keys),
            options=[
                # gRPC sets SO_REUSEPORT by default, so a second server on a busy port would start and
                # the kernel would split new connections between the two.
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", _max_request_bytes(cfg)),
            ],
        )
        self._add_inference_service(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        try:
            self.port = _listen(
                "--port", cfg.host, cfg.port, lambda: server.add_insecure_port(_host_port(cfg.host, cfg.port))
            )
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await server.start()
            self._grpc = server
            if cfg.metrics_port is not None:
                self._metrics_server = _listen(
                    "--metrics-port",
                    cfg.metrics_host,
                    cfg.metrics_port,
                    lambda: MetricsServer(self.metrics, cfg.metrics_host, cfg.metrics_port),
                )
                self.metrics_port = self._metrics_server.port
            if cfg.http_port is not None:
                from serving.http.app import HttpFrontEnd  # its dependencies only when it is on

                host = cfg.http_host or cfg.host
                port = cfg.http_port
                sock = _listen("--http-port", host, port, lambda: HttpFrontEnd.bind_socket(host, port))
                self.http = HttpFrontEnd(cfg, self.metrics, files=self.files, pools=self.pools)
                await self.http.start(sock)  # answers 503 (warming up) until attach()
                self.http_port = self.http.port
        except BaseException:
            await self._close_listeners()
            raise

    async def attach(self, engine: EngineProtocol, tokenizer: Tokenizer, warmup: bool = True) -> None:
        """Puts `engine` behind the listening server: warm-up (compiles), scheduler, health SERVING.
        A model with a vision tower (`engine.model.vision`) gets an ImagePipeline for both front ends."""
        if self._grpc is None:
            raise RuntimeError("Server.attach needs bind() first")
        scheduler = Scheduler(engine, tokenizer, self.config, self.metrics)  # checks the engine's shapes
        images = image_pipeline(engine, self.config, self.metrics)
        if warmup:
            await asyncio.to_thread(engine.warmup)  # with the image variant of prefill (JaxEngine)
            if images is not None:
                await asyncio.to_thread(warm_vision_encoder, images.encoder, images.vcfg)
        self.engine, self.scheduler, self.images = engine, scheduler, images
        scheduler.start()
        self.servicer = InferenceServicer(
            scheduler, tokenizer, self.config, images=images, files=self.files, pools=self.pools
        )
        if self.http is not None:
            self.http.attach(scheduler, tokenizer, images=images)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def start(self, engine: EngineProtocol, tokenizer: Tokenizer, warmup: bool = True) -> None:
        await self.bind()
        try:
            await self.attach(engine, tokenizer, warmup)
        except BaseException:
            await self._close_listeners()
            raise

    def _add_inference_service(self, server: grpc.aio.Server) -> None:
        """Registers ced.v1.InferenceService from its descriptor: every method with `_deserializer` and
        behind `_gate` (instead of the generated add_InferenceServiceServicer_to_server)."""
        service = ced_pb2.DESCRIPTOR.services_by_name["InferenceService"]
        handlers = {}
        for method in service.methods:
            if method.client_streaming:
                raise NotImplementedError(f"{method.full_name}: client-streaming methods are not gated")
            make = (
                grpc.unary_stream_rpc_method_handler
                if method.server_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            handlers[method.name] = make(
                self._gate(method.name, method.server_streaming),
                request_deserializer=_deserializer(
                    message_factory.GetMessageClass(method.input_type),
                    functools.partial(self._request_limit, method.name),
                ),
                response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        server.add_registered_method_handlers(service.full_name, handlers)

    def _request_limit(self, method: str) -> int | None:
        """The most bytes a request of `method` may have (None before attach()): gRPC's own receive
        limit is one for every method, set before the model is known, so each is checked here."""
        if self.servicer is None:
            return None
        cfg = self.config
        if method == "Tokenize":
            return cfg.max_tokenize_bytes + _ROOM_FOR_OTHER_FIELDS_BYTES
        if method == "Generate":
            images = cfg.max_images_per_request * cfg.max_image_bytes if self.images is not None else 0
            return cfg.max_prompt_bytes + images + _ROOM_FOR_OTHER_FIELDS_BYTES
        return _ROOM_FOR_OTHER_FIELDS_BYTES  # GetModelInfo, Abort: ids and names only

    def _gate(self, name: str, streaming: bool):
        """The handler of method `name`: an undecodable request gets INVALID_ARGUMENT, any call before
        attach() UNAVAILABLE; otherwise the servicer's method answers."""

        async def admit(request, context):
            if isinstance(request, _UndecodableRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            if isinstance(request, _OversizedRequest):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, request.message)
            if request is _NOT_READY or self.servicer is None:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "warming up: the model is loading or compiling; health turns SERVING when ready",
                )
            return getattr(self.servicer, name)

        if streaming:

            async def behavior(request, context):
                method = await admit(request, context)
                # aclosing: when grpc stops iterating (cancel, disconnect), the servicer's stream is
                # closed now (its `finally` aborts the request), not whenever it is garbage-collected.
                async with contextlib.aclosing(method(request, context)) as responses:
                    async for response in responses:
                        yield response

        else:

            async def behavior(request, context):
                method = await admit(request, context)
                return await method(request, context)

        behavior.__name__ = name
        return behavior

    async def _close_listeners(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
            self._grpc = None
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None

    async def lose_peer(self, line: str) -> None:
        """A process of a multi-host run is gone (`serving.engine.multihost.PeerWatch`): the mesh cannot run a
        program any more, so health turns NOT_SERVING, new requests are refused and those in flight
        are aborted (their streams end with ABORT as soon as the scheduler thread can say so)."""
        log.error("%s", line)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.http is not None:
            self.http.stop_admitting()
        if self.scheduler is not None:
            self.scheduler.stop_admitting()
            self.scheduler.abort_all()

    def end_grace_period(self) -> None:
        """Cuts a shutdown's grace period short: whatever is still in flight is aborted at once."""
        self._grace_over.set()

    async def shutdown(self, grace_period_s: float | None = None) -> None:
        """Graceful stop: refuse new work, drain for the grace period, abort the rest, stop."""
        grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
        loop = asyncio.get_running_loop()
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.stop_admitting()  # /health 503, new requests 503; running streams carry on
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.stop_admitting()
            end = loop.time() + grace
            while scheduler.num_in_flight and loop.time() < end and not self._grace_over.is_set():
                await asyncio.sleep(0.02)
            if scheduler.num_in_flight:
                n = scheduler.abort_all()
                log.warning("grace period over: aborting %d in-flight requests", n)
            # Let the handlers send their final (ABORT) messages before the transport goes away.
            end = loop.time() + 5.0
            while (scheduler.num_in_flight or self.servicer.active_streams) and loop.time() < end:
                await asyncio.sleep(0.01)
        await self._close_listeners()
        self.pools.close()
        if scheduler is not None:
            await asyncio.to_thread(scheduler.shutdown)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve_async(
    config: ServeConfig, load: Callable[[], tuple[EngineProtocol, Tokenizer]], *, ready=None, cluster=None
) -> int:
    """Serves until SIGTERM/SIGINT, then shuts down gracefully; returns the exit code (0).

    cluster: the leader's `serving.engine.multihost.Cluster` of a multi-host run (None: one process); once
    serving, a `PeerWatch` turns health NOT_SERVING if another process dies (`Server.lose_peer`).

    `load()` builds the engine and its tokenizer (loading the model); it runs on a worker thread after
    every port is bound. During start-up SIGTERM and SIGINT end the process at once (their default
    action: nothing has been admitted, so there is nothing to drain, and Python's SIGINT handler would
    only interrupt the event loop while the loading thread carries on). Once serving, the first signal
    starts the graceful shutdown and a second one ends its grace period at once.
    """
    server = Server(config)
    await server.bind()
    line = f"ced-jax: listening on {server.address}"
    if server.metrics_port is not None:
        line += f" (metrics port {server.metrics_port})"
    if server.http_port is not None:
        line += f" (HTTP API port {server.http_port})"
    print(f"{line}; loading and warming up (health NOT_SERVING until ready) ...", flush=True)
    loop = asyncio.get_running_loop()
    previous_sigint = signal.signal(signal.SIGINT, signal.SIG_DFL)
    watch = None
    try:
        try:
            started = time.perf_counter()
            engine, tokenizer = await asyncio.to_thread(load)
            loaded = time.perf_counter()
            await server.attach(engine, tokenizer)
            print(startup_line(loaded - started, time.perf_counter() - loaded, engine), flush=True)
        except BaseException:
            await server.shutdown(grace_period_s=0.0)
            raise
        stop = asyncio.Event()

        def on_signal() -> None:
            if stop.is_set():
                print("ced-jax: second signal: ending the grace period", flush=True)
                server.end_grace_period()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if cluster is not None:
            from serving.engine.multihost import PeerWatch

            def lost(line: str) -> None:  # on the watch thread
                loop.call_soon_threadsafe(lambda: loop.create_task(server.lose_peer(line)))

            watch = PeerWatch(cluster, lost).start()
        line = f"ced-jax serving {engine.spec.model_name or 'model'} on {server.address}"
        if server.metrics_port is not None:
            line += f" metrics http://{config.metrics_host}:{server.metrics_port}/metrics"
        if server.http_port is not None:
            line += f" HTTP API {_http_url(config.http_host or config.host, server.http_port)}"
        print(line, flush=True)
        if ready is not None:
            ready(server)
        await stop.wait()
        server.scheduler.stop_admitting()  # before anything else, so "shutting down" means refusing work
        print(f"ced-jax: shutting down (grace period {config.grace_period_s:g} s)", flush=True)
        await server.shutdown()
        return 0
    finally:
        if watch is not None:
            watch.stop()
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, previous_sigint)


def startup_line(load_s: float, warmup_s: float, engine: EngineProtocol) -> str:
    """Where start-up went: loading the model, then warm-up, split into executables compiled and loaded
    from the persistent compilation cache (`JaxEngine.warmup_report`)."""
    line = f"ced-jax: started in {load_s + warmup_s:.1f} s: load {load_s:.1f} s, warm-up {warmup_s:.1f} s"
    report = getattr(engine, "warmup_report", None)
    if report:
        compiled = sum(e.compiled for e in report)
        cached = sum(e.from_cache for e in report)
        compile_s = sum(e.compile_seconds for e in report)
        cache_s = sum(e.load_seconds for e in report)
        line += (
            f" ({len(report)} program calls: {compiled} executables compiled in {compile_s:.1f} s, {cached} "
            f"loaded from the compilation cache in {cache_s:.1f} s, the rest tracing and running)"
        )
    return line


def serve(config: ServeConfig, load: Callable[[], tuple[EngineProtocol, Tokenizer]], *, cluster=None) -> int:
    """Blocking entry point for `ced-jax serve` (see serve_async); returns the process exit code."""
    return asyncio.run(serve_async(config, load, cluster=cluster))
