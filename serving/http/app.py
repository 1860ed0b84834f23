"""The HTTP front end: OpenAI Chat Completions / Completions (FIM) / Responses and Anthropic Messages.

Served by uvicorn in the gRPC server's process and event loop (`HttpFrontEnd`): `Server.bind` binds its
socket through `_listen` (a busy port fails before the model loads) and starts it answering 503 while
the model warms up; `Server.attach` hands it the scheduler; `Server.shutdown` stops it.

Routes (api-surface §1): chat on `/chat/completions`, `/v1/chat/completions`, `/beta/chat/completions`;
FIM on `/completions`, `/v1/completions`, `/beta/completions`; `/responses`, `/v1/responses`; Anthropic
Messages on `/anthropic/v1/messages`, `/anthropic/messages`, `/v1/messages`; `GET /models`,
`/v1/models`; `GET /health`. Every error is in its API's error body (`errors.py`); a handler never lets
a traceback reach a client (an unexpected exception is logged and answered 500 "internal error").

API keys (`--api-key` / `--api-key-file`, serving/tenants.py, constant-time check): OpenAI routes take
`Authorization: Bearer KEY`; Anthropic routes `x-api-key: KEY` or Bearer (Authorization wins).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from datetime import UTC, datetime
from typing import Any

import deepseek_recipe as d
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.config import ServeConfig
from serving.http import stream as gen
from serving.http.accounting import CostLedger
from serving.http.convert import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Converter, Prepared
from serving.http.errors import ApiError
from serving.http.limits import Admission, TooManyRequests
from serving.http.models import ModelCatalog
from serving.tenants import Unauthenticated

log = logging.getLogger(__name__)

CHAT_PATHS = (
    "/chat/completions",
    "/v1/chat/completions",
    "/beta/chat/completions",
    "/beta/v1/chat/completions",
)
FIM_PATHS = ("/completions", "/v1/completions", "/beta/completions")
RESPONSES_PATHS = ("/responses", "/v1/responses")
MESSAGES_PATHS = ("/anthropic/v1/messages", "/anthropic/messages", "/v1/messages")
MODELS_PATHS = ("/models", "/v1/models")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DISCONNECT_POLL_S = 0.25


def _is_anthropic(path: str) -> bool:
    return path in MESSAGES_PATHS or path.startswith("/anthropic")


def _error_response(err: ApiError, anthropic: bool) -> JSONResponse:
    return JSONResponse(err.body(anthropic), status_code=err.status, headers=err.headers)


class HttpFrontEnd:
    """The ASGI app plus its uvicorn server on a pre-bound socket; `attach` makes it serve."""

    def __init__(self, config: ServeConfig, metrics=None):
        self.config = config
        self.metrics = metrics
        registry = None if metrics is None else metrics.registry  # exported on the server's /metrics
        self.catalog = ModelCatalog(config.http_models, registry=registry)
        self.admission = Admission(config.http_limits, registry=registry)
        self.ledger = CostLedger(config.http_pricing, registry=registry)
        self.scheduler = None
        self.converter: Converter | None = None
        self.tokenizer: d.Tokenizer | None = None
        self.unavailable: str | None = "warming up: the model is loading or compiling"
        self.app = self._build_app()
        self._server = None
        self._task: asyncio.Task | None = None
        self.socket: socket.socket | None = None
        self.port: int | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    @staticmethod
    def bind_socket(host: str, port: int) -> socket.socket:
        """A listening TCP socket on host:port (SO_REUSEADDR, as uvicorn sets it)."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=2048)
        sock.setblocking(False)
        return sock

    async def start(self, sock: socket.socket) -> None:
        """Serves the app on `sock` (already listening) in this event loop."""
        import uvicorn

        class _Server(uvicorn.Server):
            # The process's signals belong to serving.server.serve_async, not to uvicorn.
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.socket = sock
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(
            self.app, lifespan="off", access_log=False, log_level="warning", timeout_graceful_shutdown=5
        )
        self._server = _Server(cfg)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="ced-http")
        for _ in range(500):  # serve() sets `started` once the socket is being accepted on
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what uvicorn raised

    def attach(self, scheduler, tokenizer) -> None:
        """Serves `scheduler`'s model; without a tokenizer.json the routes answer 503 saying why."""
        path = _tokenizer_file(tokenizer)
        if path is None:
            self.unavailable = "this model has no tokenizer.json; the HTTP API needs one"
            return
        import tokenizers

        cfg = self.config
        self.converter = Converter(
            tokenizers.Tokenizer.from_file(str(path)),
            catalog=self.catalog,
            max_context=scheduler.spec.max_context,
            max_tokens_limit=cfg.max_tokens_limit,
            max_logprobs=cfg.max_logprobs,
        )
        self.tokenizer = d.Tokenizer.from_file(str(path))
        self.scheduler = scheduler
        self.unavailable = None

    def stop_admitting(self) -> None:
        self.unavailable = "the server is shutting down"

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
            self._server = None
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    # ---- the app ---------------------------------------------------------------------------------
    def _build_app(self) -> Starlette:
        routes = [Route("/health", self._health, methods=["GET"])]
        routes += [Route(p, self._models, methods=["GET"]) for p in MODELS_PATHS]
        for paths, api in ((CHAT_PATHS, CHAT), (FIM_PATHS, COMPLETIONS), (RESPONSES_PATHS, RESPONSES)):
            routes += [Route(p, self._handler(api), methods=["POST"]) for p in paths]
        routes += [Route(p, self._handler(MESSAGES), methods=["POST"]) for p in MESSAGES_PATHS]

        async def http_error(request: Request, exc: HTTPException):
            status = exc.status_code
            msg = {404: f"{request.url.path}: no such route", 405: f"{request.method} {request.url.path}: "
                   "method not allowed"}.get(status, str(exc.detail))  # fmt: skip
            return _error_response(ApiError(status, msg), _is_anthropic(request.url.path))

        async def any_error(request: Request, exc: Exception):
            log.exception("HTTP %s %s failed", request.method, request.url.path)
            return _error_response(ApiError(500, "internal error"), _is_anthropic(request.url.path))

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: any_error})

    async def _health(self, request: Request) -> Response:
        if self.unavailable is not None:
            return JSONResponse({"status": "unavailable", "reason": self.unavailable}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        try:
            self._authenticate(request, anthropic=False)
        except ApiError as e:
            return _error_response(e, False)
        return JSONResponse({"object": "list", "data": self.catalog.listed()})

    def _authenticate(self, request: Request, anthropic: bool) -> str | None:
        """The API key's identity (None without keys configured); 401 in the API's format otherwise."""
        keys = self.config.api_keys
        if keys is None:
            return None
        h = request.headers
        auth, xkey = h.get("authorization"), h.get("x-api-key")
        if auth is not None or not anthropic:
            metadata = [] if auth is None else [("authorization", auth)]
        else:
            metadata = [] if xkey is None else [("x-api-key", xkey)]
        try:
            return keys.authenticate(metadata)
        except Unauthenticated as e:
            how = "x-api-key: KEY or Authorization: Bearer KEY" if anthropic else "Authorization: Bearer KEY"
            msg = (
                f"Authentication Fails: {e}" if metadata else f"Authentication Fails: no API key; send {how}"
            )
            raise ApiError(401, msg) from None

    def _handler(self, api: str):
        anthropic = api == MESSAGES

        async def handle(request: Request) -> Response:
            try:
                return await self._handle(api, request)
            except ApiError as e:
                return _error_response(e, anthropic)

        handle.__name__ = f"handle_{api}"
        return handle

    async def _handle(self, api: str, request: Request) -> Response:
        identity = self._authenticate(request, anthropic=api == MESSAGES)
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable, headers={"Retry-After": "5"})
        raw = await request.body()
        p: Prepared = await asyncio.to_thread(self.converter.prepare, api, raw)
        if identity is None:
            identity = p.identity_hint[: self.config.max_user_length]
        headers = self.catalog.headers(p.model)  # an alias: Deprecation / warning headers
        rid = gen.response_id(api)
        outcome = gen.Outcome()
        if p.stream:
            events = self._sse(api, p, rid, identity, outcome)
            first = await _first(events)  # admission errors answer as HTTP errors, not inside a stream
            return StreamingResponse(
                _chain(first, events), media_type="text/event-stream", headers={**_SSE_HEADERS, **headers}
            )
        async with self._admitted(p):
            work = asyncio.ensure_future(self._full(api, p, rid, identity, outcome))
            try:
                body = await _unless_disconnected(request, work)
            finally:
                self._account(outcome)
        return Response(body, media_type="application/json", headers=headers)

    @contextlib.asynccontextmanager
    async def _admitted(self, p: Prepared):
        """Holds the request's admission (serving/http/limits.py) for its whole life: effort `max`
        requests go through their own tier; beyond the limits: 429 with Retry-After."""
        tier = "max" if p.thinking and p.effort is not None and p.effort >= 100 else "default"
        try:
            admission = self.admission.admit(tier)
            await admission.__aenter__()
        except TooManyRequests as e:
            raise ApiError(429, e.message, headers=e.headers) from None
        try:
            yield
        finally:
            await admission.__aexit__(None, None, None)

    def _account(self, outcome: gen.Outcome) -> None:
        """Prices a finished request on the hosted API's table (serving/http/accounting.py)."""
        u = outcome.usage
        if u is None:
            return
        hit = u.cached_prompt_tokens
        self.ledger.record(hit, u.prompt_tokens - hit, u.completion_tokens, datetime.now(UTC))

    # ---- streaming -------------------------------------------------------------------------------
    async def _sse(self, api: str, p: Prepared, rid: str, identity: str, outcome: gen.Outcome):
        """SSE messages. The first item is yielded once the request is admitted (or raises)."""
        async with self._admitted(p):
            try:
                async for item in self._sse_admitted(api, p, rid, identity, outcome):
                    yield item
            finally:
                self._account(outcome)

    async def _sse_admitted(self, api: str, p: Prepared, rid: str, identity: str, outcome: gen.Outcome):
        if api == COMPLETIONS:
            objs = gen.fim_objects(self.scheduler, p, rid, identity, outcome)
            started = False
            try:
                async for o in objs:
                    started = True
                    yield f"data: {json.dumps(o)}\n\n"
                yield "data: [DONE]\n\n"
            except ApiError as e:
                if not started:
                    raise
                yield gen.sse_error(api, e)
            finally:
                await objs.aclose()
            return
        chunks = gen.chunks(
            self.scheduler, p, self.tokenizer, self.converter.think_end_id, rid, identity, outcome
        )
        started = False
        try:
            async for batch in chunks:
                started = True
                text = "".join(gen.sse(api, c, outcome) for c in batch)
                if text:
                    yield text
            yield gen.sse_done(api)
        except ApiError as e:
            if not started:
                raise
            yield gen.sse_error(api, e)
        finally:
            await chunks.aclose()

    # ---- non-streaming ---------------------------------------------------------------------------
    async def _full(self, api: str, p: Prepared, rid: str, identity: str, outcome: gen.Outcome) -> bytes:
        if api == COMPLETIONS:
            text, last = "", None
            async for o in gen.fim_objects(self.scheduler, p, rid, identity, outcome):
                text += o["choices"][0]["text"]
                last = o
            last["choices"][0]["text"] = text
            last["usage"] = last.get("usage")
            return json.dumps(last).encode()
        collected = []
        async for batch in gen.chunks(
            self.scheduler, p, self.tokenizer, self.converter.think_end_id, rid, identity, outcome
        ):
            collected += batch
        u = outcome.usage
        cached = u.cached_prompt_tokens if u is not None else 0
        resp = gen.new_response(api, rid, p.model.requested, len(p.prompt_ids), cached)
        for c in collected:
            resp.accumulate(c)
        if u is None:
            return resp.to_json().encode()
        return json.dumps(
            gen.patch_usage(api, json.loads(resp.to_json()), outcome), ensure_ascii=False
        ).encode()


def _tokenizer_file(tokenizer):
    """The tokenizer.json behind a serving tokenizer (`ModelTokenizer.tokenizer_file`); None if none."""
    return getattr(tokenizer, "tokenizer_file", None)


async def _first(agen):
    """The first item of `agen` (raising what it raises before that), or None if it is empty."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first: Any, agen):
    try:
        if first is not None:
            yield first
        async for item in agen:
            yield item
    finally:
        await agen.aclose()


async def _unless_disconnected(request: Request, work: asyncio.Future):
    """`work`'s result, or cancel it (its `finally` aborts the engine request) if the client leaves."""
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=_DISCONNECT_POLL_S)
            if done:
                return work.result()
            if await request.is_disconnected():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                raise ApiError(499, "client closed the request")
    except BaseException:
        if not work.done():
            work.cancel()
        raise
