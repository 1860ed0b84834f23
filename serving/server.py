"""The gRPC front end: translates ced.v1 messages to scheduler calls and back, nothing more.

Request flow: `Generate` validates the proto fields (INVALID_ARGUMENT naming the field), tokenizes a
text prompt off the event loop, and submits a `GenerationRequest`; the scheduler thread streams
`StreamEvent`s back through an asyncio queue and each becomes one `GenerateResponse`. If the client
cancels, disconnects or its deadline passes, grpc.aio cancels the handler; the `finally` closes the
stream, which aborts the request so its slot and pages are freed in the next scheduler step.

Shutdown (SIGTERM or SIGINT in `serve`): health turns NOT_SERVING and new Generate calls get
UNAVAILABLE; in-flight streams may finish for up to `grace_period_s`; whatever is still running is then
aborted, so its stream ends normally with finish_reason ABORT; the gRPC server stops and `serve`
returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import signal
import sys
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.config import ServeConfig
from serving.engine_api import Engine, SamplingParams
from serving.metrics import Metrics, MetricsServer
from serving.proto import ced_pb2, ced_pb2_grpc
from serving.scheduler import (
    AdmissionError,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    Scheduler,
    StreamEvent,
)
from serving.tenants import Unauthenticated, server_interceptors
from serving.text import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = ced_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
_MAX_TEMPERATURE = 100.0
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
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, config: ServeConfig):
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._config = config
        self.active_streams = 0

    async def _encode(self, text: str) -> list[int]:
        # Tokenizing a long prompt takes milliseconds of CPU; keep it off the event loop.
        return await asyncio.to_thread(self._tokenizer.encode, text)

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

    async def _to_request(self, request: ced_pb2.GenerateRequest, context) -> GenerationRequest:
        identity = await self._identity(context, request.user)
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequest("prompt", "one of prompt or prompt_token_ids is required")
        if which == "prompt":
            if not request.prompt:
                raise InvalidRequest("prompt", "is empty")
            ids = tuple(await self._encode(request.prompt))
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
        )

    async def Generate(self, request, context):
        self.active_streams += 1
        try:
            try:
                req = await self._to_request(request, context)
                stream = self._scheduler.submit_async(req)
            except InvalidRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except AdmissionError as e:
                await context.abort(_ADMISSION_CODES[e.kind], str(e))
            try:
                async for ev in stream:
                    if ev.error is not None:
                        await context.abort(grpc.StatusCode.INTERNAL, f"engine failure: {ev.error}")
                    if ev.deadline_exceeded:
                        # The scheduler noticed the deadline before gRPC did; answer as gRPC would.
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    yield event_to_proto(ev)
            finally:
                stream.close()  # a no-op after the final event; otherwise aborts the request
        finally:
            self.active_streams -= 1

    async def Tokenize(self, request, context):
        return ced_pb2.TokenizeResponse(token_ids=await self._encode(request.text))

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
            ),
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


class Server:
    """A running server: engine warm-up, scheduler thread, gRPC (with health and reflection), metrics."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: ServeConfig):
        self.config = config
        self.engine = engine
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, tokenizer, config, self.metrics)
        self.servicer = InferenceServicer(self.scheduler, tokenizer, config)
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self, warmup: bool = True) -> None:
        if warmup:
            await asyncio.to_thread(self.engine.warmup)
        self.scheduler.start()
        server = grpc.aio.server(interceptors=server_interceptors(self.config.api_keys))
        ced_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        try:
            self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        except RuntimeError:
            await asyncio.to_thread(self.scheduler.shutdown)
            raise ValueError(
                f"cannot listen on {self.config.host}:{self.config.port} (port in use? choose --port)"
            ) from None
        await server.start()
        self._grpc = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(
                self.metrics, self.config.metrics_host, self.config.metrics_port
            )
            self.metrics_port = self._metrics_server.port

    async def shutdown(self, grace_period_s: float | None = None) -> None:
        """Graceful stop: refuse new work, drain for the grace period, abort the rest, stop."""
        grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
        loop = asyncio.get_running_loop()
        await self.health.enter_graceful_shutdown()
        self.scheduler.stop_admitting()
        end = loop.time() + grace
        while self.scheduler.num_in_flight and loop.time() < end:
            await asyncio.sleep(0.02)
        if self.scheduler.num_in_flight:
            n = self.scheduler.abort_all()
            log.warning("grace period over: aborting %d in-flight requests", n)
        # Let the handlers send their final (ABORT) messages before the transport goes away.
        end = loop.time() + 5.0
        while (self.scheduler.num_in_flight or self.servicer.active_streams) and loop.time() < end:
            await asyncio.sleep(0.01)
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await asyncio.to_thread(self.scheduler.shutdown)
        if self._metrics_server is not None:
            self._metrics_server.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve_async(engine: Engine, tokenizer: Tokenizer, config: ServeConfig, *, ready=None) -> int:
    """Serves until SIGTERM/SIGINT, then shuts down gracefully; returns the exit code (0)."""
    server = Server(engine, tokenizer, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    line = f"ced-jax serving {engine.spec.model_name or 'model'} on {server.address}"
    if server.metrics_port is not None:
        line += f" metrics http://{config.metrics_host}:{server.metrics_port}/metrics"
    print(line, flush=True)
    if ready is not None:
        ready(server)
    await stop.wait()
    server.scheduler.stop_admitting()  # before anything else, so "shutting down" means refusing work
    print(f"ced-jax: shutting down (grace period {config.grace_period_s:g} s)", flush=True)
    await server.shutdown()
    return 0


def serve(engine: Engine, tokenizer: Tokenizer, serve_config: ServeConfig) -> int:
    """Blocking entry point for `ced-jax serve`; returns the process exit code."""
    return asyncio.run(serve_async(engine, tokenizer, serve_config))


def _mock_main(argv: list[str]) -> int:
    """`python -m serving.server --mock [--grace S]`: serve the mock engine (tests, demos)."""
    import argparse

    from serving.mock_engine import ByteTokenizer, MockEngine

    p = argparse.ArgumentParser(prog="python -m serving.server")
    p.add_argument("--mock", action="store_true", required=True)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    engine = MockEngine(
        max_slots=4,
        page_size=4,
        num_pages=64,
        max_context=64,
        prefill_buckets=(4, 8, 16),
        step_delay_s=a.step_delay,
    )
    config = ServeConfig(
        max_slots=4, page_size=4, num_pages=64, max_context=64, prefill_buckets=(4, 8, 16),
        max_logprobs=5, max_tokens_limit=60, default_max_tokens=16, grace_period_s=a.grace, port=a.port,
    )  # fmt: skip
    return serve(engine, ByteTokenizer(), config)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(_mock_main(sys.argv[1:]))
