"""The gRPC service: translates ced.v1 messages to scheduler calls and back, nothing more.

Request flow: `Generate` validates the proto fields (INVALID_ARGUMENT naming the field), tokenizes a
text prompt off the event loop, and submits a `GenerationRequest`; the scheduler thread streams
`StreamEvent`s back through an asyncio queue and each becomes one `GenerateResponse`. If the client
cancels, disconnects or its deadline passes, grpc.aio cancels the handler; the `finally` closes the
stream, which aborts the request so its slot and pages are freed in the next scheduler step.

Until the server has a servicer (the model loads and the engine warms up; serving/server.py), every
InferenceService call is answered UNAVAILABLE ("warming up") by the handlers `add_inference_service`
registers.

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

import contextlib
import dataclasses
import functools
import math
import secrets
import uuid
from collections.abc import Callable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from serving.config import ServeConfig
from serving.constraints import constraint_from_proto
from serving.engine.protocol import SamplingParams
from serving.errors import AdmissionError, InvalidRequest
from serving.files import FileError, FileLease, FileStore
from serving.proto import ced_pb2, ced_pb2_grpc
from serving.requests import FinishReason, GenerationRequest, StreamEvent
from serving.scheduling.scheduler import Scheduler
from serving.tenants import Unauthenticated
from serving.text import Tokenizer
from serving.vision import ImageInputError, ImagePipeline
from serving.work_pools import PoolBusy, WorkPools, peer_tenant

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

    def request_limit(self, method: str) -> int:
        """The most bytes a request of `method` may have: the text limits, and images only on a model
        that takes them."""
        cfg = self._config
        if method == "Tokenize":
            return cfg.max_tokenize_bytes + _ROOM_FOR_OTHER_FIELDS_BYTES
        if method == "Generate":
            images = cfg.max_images_per_request * cfg.max_image_bytes if self._images is not None else 0
            return cfg.max_prompt_bytes + images + _ROOM_FOR_OTHER_FIELDS_BYTES
        return _ROOM_FOR_OTHER_FIELDS_BYTES  # GetModelInfo, Abort: ids and names only

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


_NOT_READY = object()  # a request while there is no servicer: answered UNAVAILABLE without being parsed


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


# ---- request sizes ----------------------------------------------------------------------------------

_GRPC_DEFAULT_MAX_RECEIVE_BYTES = 4 << 20
_ROOM_FOR_OTHER_FIELDS_BYTES = 1 << 20  # stop strings, ids and the rest of a request beside its text


def max_receive_bytes(config: ServeConfig) -> int:
    """gRPC's receive limit: never below its default, and room for text at the configured limits (else
    gRPC would refuse a legal request first, with RESOURCE_EXHAUSTED naming no field)."""
    largest_text = max(config.max_prompt_bytes, config.max_tokenize_bytes)
    # A Generate request may also carry max_images_per_request images of max_image_bytes each (bound
    # before the model is loaded, so whether it takes images is not known yet).
    images = config.max_images_per_request * config.max_image_bytes
    return max(_GRPC_DEFAULT_MAX_RECEIVE_BYTES, largest_text + images + _ROOM_FOR_OTHER_FIELDS_BYTES)


# ---- registration -----------------------------------------------------------------------------------


def add_inference_service(server: grpc.aio.Server, servicer: Callable[[], InferenceServicer | None]) -> None:
    """Registers ced.v1.InferenceService from its descriptor: every method with `_deserializer` and
    behind `_gate` (instead of the generated add_InferenceServiceServicer_to_server). `servicer()`: the
    servicer that answers, None while the model loads (calls get UNAVAILABLE "warming up")."""
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
            _gate(method.name, method.server_streaming, servicer),
            request_deserializer=_deserializer(
                message_factory.GetMessageClass(method.input_type),
                functools.partial(_request_limit, servicer, method.name),
            ),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _request_limit(servicer: Callable[[], InferenceServicer | None], method: str) -> int | None:
    """The most bytes a request of `method` may have (None while there is no servicer): gRPC's own
    receive limit is one for every method, set before the model is known, so each is checked here."""
    serving = servicer()
    if serving is None:
        return None
    return serving.request_limit(method)


def _gate(name: str, streaming: bool, servicer: Callable[[], InferenceServicer | None]):
    """The handler of method `name`: an undecodable request gets INVALID_ARGUMENT, any call before
    there is a servicer UNAVAILABLE; otherwise the servicer's method answers."""

    async def admit(request, context):
        if isinstance(request, _UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if isinstance(request, _OversizedRequest):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, request.message)
        serving = servicer()
        if request is _NOT_READY or serving is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "warming up: the model is loading or compiling; health turns SERVING when ready",
            )
        return getattr(serving, name)

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
