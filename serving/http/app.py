"""The HTTP front end: OpenAI Chat Completions / Completions (FIM) / Responses and Anthropic Messages.

Served by uvicorn in the gRPC server's process and event loop (`HttpFrontEnd`): `Server.bind` binds its
socket through `_listen` (a busy port fails before the model loads) and starts it answering 503 while
the model warms up; `Server.attach` hands it the scheduler; `Server.shutdown` stops it.

Routes (api-surface §1): chat on `/chat/completions`, `/v1/chat/completions`, `/beta/chat/completions`;
completions (plain, or FIM with a `suffix`) on `/completions`, `/v1/completions`, `/beta/completions`;
`/responses`, `/v1/responses`; Anthropic Messages on `/anthropic/v1/messages`, `/anthropic/messages`,
`/v1/messages`; `GET /models`, `/v1/models`; `GET /health`; token counting (serving/http/tokenize.py):
`/tokenize`, `/detokenize` (vLLM's) and Anthropic's `/v1/messages/count_tokens`. Every request field
is in serving/http/fields.py's tables: one it does not list is refused (400 naming it). Every error is
in its API's error body (`errors.py`); a handler never lets
a traceback reach a client (an unexpected exception is logged and answered 500 "internal error").

API keys (`--api-key` / `--api-key-file`, serving/tenants.py, constant-time check): OpenAI routes take
`Authorization: Bearer KEY`; Anthropic routes `x-api-key: KEY` or Bearer (Authorization wins).

Images (issue 14): image parts in every API (serving/http/images.py) as base64, Files API ids or URLs
(fetched only when `ImageFetchConfig.allow_image_urls`, serving/image_fetch.py); expanded into spans by the
engine's `ImagePipeline` given to `attach` (None: the model has no vision tower, image parts answer 400).
Files API on `/files`, `/v1/files`, `/anthropic/v1/files` (serving/files.py): `POST` (multipart `file`,
`purpose`), `GET` (list), `GET /{id}`, `GET /{id}/content`, `DELETE /{id}`; OpenAI's file objects, or
Anthropic's when the request comes from the Anthropic SDK (an `anthropic-version` / `anthropic-beta`
header or the `/anthropic` prefix). Files belong to the API key's identity (without keys: one shared
anonymous scope, as unauthenticated as the rest of the API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from datetime import UTC, datetime
from typing import Any

import deepseek_recipe as d
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.accounting import CostLedger
from serving.admission import Admission, TooManyRequests
from serving.config import ServeConfig
from serving.files import IMAGE_PURPOSES, FileError, FilesConfig, FileStore, StoredFile
from serving.http import stream as gen
from serving.http import tokenize as counting
from serving.http.convert import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Converter, Prepared, parse_body
from serving.http.errors import ApiError
from serving.http.images import ImageResolver
from serving.image_fetch import ImageFetchConfig, ImageFetcher, ImageInputConfig
from serving.model_names import ModelCatalog
from serving.tenants import Unauthenticated
from serving.work_pools import FairPool, PoolBusy, WorkPools

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
TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")
DETOKENIZE_PATHS = ("/detokenize", "/v1/detokenize")
COUNT_TOKENS_PATHS = ("/anthropic/v1/messages/count_tokens", "/v1/messages/count_tokens")
FILES_PATHS = ("/files", "/v1/files", "/anthropic/v1/files")
_UPLOAD_OVERHEAD = 64 * 1024  # multipart headers and the other form fields, beyond the file's own bytes


class _UploadTooLarge(Exception):
    """An upload body passed the file size limit while it streamed in."""


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DISCONNECT_POLL_S = 0.25


def _is_anthropic(path: str) -> bool:
    return path in MESSAGES_PATHS or path.startswith("/anthropic")


def _error_response(err: ApiError, anthropic: bool) -> JSONResponse:
    return JSONResponse(err.body(anthropic), status_code=err.status, headers=err.headers)


class HttpFrontEnd:
    """The ASGI app plus its uvicorn server on a pre-bound socket; `attach` makes it serve."""

    def __init__(
        self,
        config: ServeConfig,
        metrics=None,
        files: FileStore | None = None,
        pools: WorkPools | None = None,
    ):
        """`files` and `pools`: the server's file store and work pools, when it shares them with the
        gRPC service (else its own)."""
        self.config = config
        self._own_pools = pools is None
        self.pools = WorkPools.from_config(config) if pools is None else pools
        self.metrics = metrics
        registry = None if metrics is None else metrics.registry  # exported on the server's /metrics
        self.catalog = ModelCatalog(config.http_models, registry=registry)
        self.admission = Admission(config.http_limits, registry=registry)
        self.ledger = CostLedger(config.http_pricing, registry=registry)
        # ServeConfig carries these as http_files / http_image_fetch / http_images; defaults without them.
        files_cfg = getattr(config, "http_files", None) or FilesConfig()
        fetch_cfg = getattr(config, "http_image_fetch", None) or ImageFetchConfig()
        image_cfg = getattr(config, "http_images", None) or ImageInputConfig()
        self.files = files if files is not None else FileStore(files_cfg)
        self.image_resolver = ImageResolver(
            self.files,
            ImageFetcher(fetch_cfg),
            image_cfg,
            registry=registry,
            fetch_pool=self.pools.image_fetch,
        )
        if registry is not None:
            from prometheus_client import Gauge

            stored = Gauge(
                "ced_files_stored_bytes", "Files API bytes held (distinct content, leased gone files too).",
                registry=registry,
            )  # fmt: skip
            stored.set_function(lambda: self.files.stored_bytes)
            records = Gauge(
                "ced_files_records", "Files API records held (leased gone files included).", registry=registry
            )
            records.set_function(lambda: self.files.record_count)
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

    def attach(self, scheduler, tokenizer, images=None) -> None:
        """Serves `scheduler`'s model; without a tokenizer.json the routes answer 503 saying why.
        `images`: the engine's ImagePipeline (serving/vision.py); None: the model takes no images."""
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
            images=images,
            resolver=self.image_resolver,
            max_prompt_bytes=cfg.max_prompt_bytes,
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
        if self._own_pools:
            self.pools.close()

    # ---- the app ---------------------------------------------------------------------------------
    def _build_app(self) -> Starlette:
        routes = [Route("/health", self._health, methods=["GET"])]
        routes += [Route(p, self._models, methods=["GET"]) for p in MODELS_PATHS]
        for paths, api in ((CHAT_PATHS, CHAT), (FIM_PATHS, COMPLETIONS), (RESPONSES_PATHS, RESPONSES)):
            routes += [Route(p, self._handler(api), methods=["POST"]) for p in paths]
        routes += [Route(p, self._handler(MESSAGES), methods=["POST"]) for p in MESSAGES_PATHS]
        for paths, job, anthropic in (
            (TOKENIZE_PATHS, "tokenize", False),
            (DETOKENIZE_PATHS, "detokenize", False),
            (COUNT_TOKENS_PATHS, "count_tokens", True),
        ):
            routes += [Route(p, self._counting(job, anthropic), methods=["POST"]) for p in paths]
        for p in FILES_PATHS:
            routes += [
                Route(p, self._files_route(self._files_collection), methods=["GET", "POST"]),
                Route(p + "/{file_id}", self._files_route(self._file_item), methods=["GET", "DELETE"]),
                Route(p + "/{file_id}/content", self._files_route(self._file_content), methods=["GET"]),
            ]

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

    def _counting(self, job: str, anthropic: bool):
        """A token counting route (serving/http/tokenize.py), run on the `prepare` pool as requests are."""

        async def handle(request: Request) -> Response:
            try:
                identity = self._authenticate(request, anthropic)
                if self.unavailable is not None:
                    raise ApiError(503, self.unavailable, headers={"Retry-After": "5"})
                body = parse_body(await self._read_body(request))
                tenant = (
                    identity
                    if identity is not None
                    else f"addr:{request.client.host if request.client else ''}"
                )
                work = {
                    "tokenize": lambda: counting.tokenize(self.converter, body, identity or ""),
                    "detokenize": lambda: counting.detokenize(self.converter, body),
                    "count_tokens": lambda: counting.count_tokens(self.converter, body, identity or ""),
                }[job]
                try:
                    out = await asyncio.wrap_future(self.pools.prepare.submit(tenant, work))
                except PoolBusy as e:
                    raise ApiError(429, str(e), headers={"Retry-After": "1"}) from None
                return JSONResponse(out)
            except ApiError as e:
                return _error_response(e, anthropic)

        handle.__name__ = f"handle_{job}"
        return handle

    async def _handle(self, api: str, request: Request) -> Response:
        identity = self._authenticate(request, anthropic=api == MESSAGES)
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable, headers={"Retry-After": "5"})
        try:
            self.admission.refuse_if_full()
        except TooManyRequests as e:
            raise ApiError(429, e.message, headers=e.headers) from None
        raw = await self._read_body(request)
        # The work pools are shared between API keys, or (without keys) client addresses.
        tenant = identity if identity is not None else f"addr:{request.client.host if request.client else ''}"
        try:
            p = await _prepare(self.pools.prepare, tenant, self.converter, api, raw, identity or "")
        except PoolBusy as e:
            raise ApiError(429, str(e), headers={"Retry-After": "1"}) from None
        response = None
        try:
            response = await self._run(api, request, p, identity)
            return response
        finally:
            # A stream releases its file leases when it ends (_sse), as does a keep-alive answer.
            if not p.stream and not getattr(response, "owns_request", False):
                p.release()

    def body_limit(self) -> int:
        """The most bytes a request body may have (ServeConfig.http_max_body_bytes)."""
        cfg = self.config
        if cfg.http_max_body_bytes is not None:
            return cfg.http_max_body_bytes
        images = getattr(self.converter, "images", None) is not None
        image_bytes = -(-4 * cfg.max_images_per_request * cfg.max_image_bytes // 3) if images else 0
        return 4 * cfg.max_prompt_bytes + (1 << 20) + image_bytes

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes `body_limit()` (before any parsing; a chunked
        body without Content-Length is counted as it streams in)."""
        limit = self.body_limit()
        length = request.headers.get("content-length")
        too_large = (
            f"request body: more than {limit} bytes; the limit is http_max_body_bytes = {limit} "
            "(--http-max-body-bytes)"
        )
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, too_large)
        chunks, received = [], 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise ApiError(413, too_large)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _run(self, api: str, request: Request, p: Prepared, identity: str | None) -> Response:
        if identity is None:
            limit = self.config.max_user_length
            if len(p.identity_hint) > limit:  # as gRPC: a cut name would share another's cache scope
                field = p.identity_field
                raise ApiError(
                    400,
                    f"{field}: has {len(p.identity_hint)} characters; the limit is max_user_length = {limit}",
                    param=field,
                )
            identity = p.identity_hint
        headers = self.catalog.headers(p.model)  # an alias: Deprecation / warning headers
        rid = gen.response_id(api)
        outcome = gen.Outcome()
        if p.stream:
            events = self._sse(api, p, rid, identity, outcome)
            first = await _first(events)  # admission errors answer as HTTP errors, not inside a stream
            return StreamingResponse(
                _chain(first, events), media_type="text/event-stream", headers={**_SSE_HEADERS, **headers}
            )
        admitted = self._admitted(p)
        await admitted.__aenter__()
        work = asyncio.ensure_future(self._full(api, p, rid, identity, outcome))
        keepalive = self.config.http_keepalive_s or None
        try:
            body = await _unless_disconnected(request, work, patience=keepalive)
        except BaseException:
            self._account(outcome)
            await admitted.__aexit__(None, None, None)
            raise
        if body is not None:
            self._account(outcome)
            await admitted.__aexit__(None, None, None)
            return Response(body, media_type="application/json", headers=headers)
        # Still working: the status and headers now, empty lines while it works (the hosted API's
        # keep-alive), then the body. The stream owns the request from here (its end releases it).
        finish = asyncio.ensure_future(self._finish(work, admitted, outcome, p, anthropic=api == MESSAGES))
        response = StreamingResponse(_keepalive(work, keepalive, finish), media_type="application/json",
                                     headers=headers)  # fmt: skip
        response.owns_request = True
        return response

    async def _finish(
        self, work: asyncio.Future, admitted, outcome: gen.Outcome, p: Prepared, *, anthropic: bool
    ):
        """The end of a keep-alive answer: the body (an error's body when the work failed), then the
        request's admission, accounting and file leases released, whatever happened."""
        try:
            try:
                return await work
            except ApiError as e:
                return json.dumps(e.body(anthropic)).encode()
            except Exception:
                log.exception("HTTP answer failed after its keep-alive lines")
                return json.dumps(ApiError(500, "internal error").body(anthropic)).encode()
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
            self._account(outcome)
            await admitted.__aexit__(None, None, None)
            p.release()

    @contextlib.asynccontextmanager
    async def _admitted(self, p: Prepared):
        """Holds the request's admission (serving/admission.py) for its whole life: effort `max`
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
        """Prices a finished request on the hosted API's table (serving/accounting.py)."""
        u = outcome.usage
        if u is None:
            return
        hit = u.cached_prompt_tokens
        self.ledger.record(hit, u.prompt_tokens - hit, u.completion_tokens, datetime.now(UTC))

    # ---- Files API -------------------------------------------------------------------------------
    def _files_route(self, method):
        """A Files API handler in the caller's API format (OpenAI or Anthropic), authenticated."""

        async def handle(request: Request) -> Response:
            anthropic = _wants_anthropic_files(request)
            try:
                scope = self._authenticate(request, anthropic) or ""
                return await method(request, scope, anthropic)
            except FileError as e:
                code = "file_not_found" if e.status == 404 else None
                return _error_response(ApiError(e.status, e.message, param=e.field, code=code), anthropic)
            except ApiError as e:
                return _error_response(e, anthropic)

        handle.__name__ = method.__name__
        return handle

    async def _files_collection(self, request: Request, scope: str, anthropic: bool) -> Response:
        if request.method == "POST":
            record = await self._upload(request, scope, anthropic)
            return JSONResponse(_file_object(record, anthropic))
        q = request.query_params
        purpose = q.get("purpose")
        files = self.files.list(scope, purpose=purpose or None)
        if q.get("order", "desc" if not anthropic else "desc") == "desc":
            files.reverse()
        after = q.get("after_id" if anthropic else "after")
        if after:
            ids = [f.id for f in files]
            files = files[ids.index(after) + 1 :] if after in ids else []
        limit = _query_int(q, "limit", 1000 if anthropic else 10000)
        page, more = files[:limit], len(files) > limit
        data = [_file_object(f, anthropic) for f in page]
        first = page[0].id if page else None
        last = page[-1].id if page else None
        if anthropic:
            return JSONResponse({"data": data, "first_id": first, "last_id": last, "has_more": more})
        return JSONResponse(
            {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
        )

    async def _file_item(self, request: Request, scope: str, anthropic: bool) -> Response:
        file_id = request.path_params["file_id"]
        if request.method == "DELETE":
            record = self.files.delete(scope, file_id)
            if anthropic:
                return JSONResponse({"id": record.id, "type": "file_deleted"})
            return JSONResponse({"id": record.id, "object": "file", "deleted": True})
        return JSONResponse(_file_object(self.files.get(scope, file_id), anthropic))

    async def _file_content(self, request: Request, scope: str, anthropic: bool) -> Response:
        record, data = self.files.content(scope, request.path_params["file_id"])
        return Response(data, media_type=record.mime_type)

    async def _upload(self, request: Request, scope: str, anthropic: bool) -> StoredFile:
        """A multipart upload (`file`, OpenAI `purpose` and `expires_after[...]`) into the store."""
        from starlette.datastructures import UploadFile

        limit = self.files.config.max_file_bytes
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(
                400, "request body: expected multipart/form-data with a `file` field", param="file"
            )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit + _UPLOAD_OVERHEAD:
            raise ApiError(
                413, f"file: the upload is {length} bytes; this server accepts files up to {limit} bytes",
                param="file",
            )  # fmt: skip
        # A chunked body has no Content-Length: the limit holds while it streams in, so an over-large
        # upload is refused at the limit instead of being spooled whole first.
        received, receive = 0, request.receive

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit + _UPLOAD_OVERHEAD:
                    raise _UploadTooLarge
            return message

        request = Request(request.scope, receive_within_limit)
        try:
            form = await request.form(max_files=1, max_fields=16)
        except _UploadTooLarge:
            raise ApiError(
                413, f"file: the upload passed {limit + _UPLOAD_OVERHEAD} bytes; this server accepts files "
                f"up to {limit} bytes", param="file",
            ) from None  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the form parser's errors are the client's malformed body
            raise ApiError(400, f"request body: malformed multipart form ({e})", param="file") from None
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "file: is required (a multipart file field)", param="file")
            purpose = form.get("purpose")
            if anthropic and purpose is None:
                purpose = "vision"
            if not isinstance(purpose, str) or not purpose:
                raise ApiError(
                    400, f"purpose: is required; one of {', '.join(IMAGE_PURPOSES)}", param="purpose"
                )
            if purpose not in IMAGE_PURPOSES:
                raise ApiError(
                    400,
                    f"purpose: {purpose!r} is not served here; this server stores images for vision input "
                    f"(purpose one of {', '.join(IMAGE_PURPOSES)})",
                    param="purpose",
                )
            expires = None
            seconds = form.get("expires_after[seconds]")
            if seconds is not None:
                anchor = form.get("expires_after[anchor]", "created_at")
                if anchor != "created_at" or not isinstance(seconds, str) or not seconds.isdigit():
                    raise ApiError(
                        400, "expires_after: expected anchor created_at and a whole number of seconds",
                        param="expires_after",
                    )  # fmt: skip
                expires = float(seconds)
            data = await upload.read(limit + 1)
            filename = upload.filename or "upload"
        finally:
            await form.close()
        return await asyncio.to_thread(
            self.files.upload, scope, data, filename=filename, purpose=purpose, expires_after_s=expires
        )

    # ---- streaming -------------------------------------------------------------------------------
    async def _sse(self, api: str, p: Prepared, rid: str, identity: str, outcome: gen.Outcome):
        """SSE messages. The first item is yielded once the request is admitted (or raises)."""
        try:
            async with self._admitted(p):
                try:
                    async for item in self._sse_admitted(api, p, rid, identity, outcome):
                        yield item
                finally:
                    self._account(outcome)
        finally:
            p.release()

    async def _sse_admitted(self, api: str, p: Prepared, rid: str, identity: str, outcome: gen.Outcome):
        if api == COMPLETIONS:
            objs = gen.completion_objects(
                self.scheduler, p, rid, identity, outcome, self.converter.token_text
            )
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
        chunks = self._chunks(p, rid, identity, outcome)
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

    def _chunks(self, p: Prepared, rid: str, identity: str, outcome: gen.Outcome):
        """The request's deepseek-recipe chunks (`stream.chunks`) with this model's tokenizer."""
        c = self.converter
        return gen.chunks(
            self.scheduler, p, self.tokenizer, c.think_end_id, rid, identity, outcome, c.hidden_special_ids
        )

    # ---- non-streaming ---------------------------------------------------------------------------
    async def _full(self, api: str, p: Prepared, rid: str, identity: str, outcome: gen.Outcome) -> bytes:
        if api == COMPLETIONS:
            text, last, lps = "", None, None
            objs = gen.completion_objects(
                self.scheduler, p, rid, identity, outcome, self.converter.token_text
            )
            async for o in objs:
                choice = o["choices"][0]
                text += choice["text"]
                if choice["logprobs"] is not None:
                    lps = (
                        choice["logprobs"]
                        if lps is None
                        else {k: lps[k] + v for k, v in choice["logprobs"].items()}
                    )
                last = o
            last["choices"][0]["text"] = text
            last["choices"][0]["logprobs"] = lps
            last["usage"] = last.get("usage")
            return json.dumps(last).encode()
        collected = []
        async for batch in self._chunks(p, rid, identity, outcome):
            collected += batch
        u = outcome.usage
        cached = u.cached_prompt_tokens if u is not None else 0
        resp = gen.new_response(api, rid, p.model.requested, len(p.prompt_ids), cached)
        for c in collected:
            resp.accumulate(c)
        obj = json.loads(resp.to_json())
        if u is not None:
            obj = gen.patch_usage(api, obj, outcome)
        return json.dumps(gen.without_cut_tool_use(api, obj), ensure_ascii=False).encode()


def _wants_anthropic_files(request: Request) -> bool:
    """The Anthropic SDK's Files API calls (it always sends anthropic-version) get Anthropic's objects."""
    h = request.headers
    return request.url.path.startswith("/anthropic") or "anthropic-version" in h or "anthropic-beta" in h


def _file_object(f: StoredFile, anthropic: bool) -> dict:
    if anthropic:
        created = datetime.fromtimestamp(f.created_at, UTC).isoformat().replace("+00:00", "Z")
        return {
            "id": f.id, "type": "file", "filename": f.filename, "mime_type": f.mime_type,
            "size_bytes": f.size, "created_at": created, "downloadable": True,
        }  # fmt: skip
    return {
        "id": f.id, "object": "file", "bytes": f.size, "created_at": f.created_at, "filename": f.filename,
        "purpose": f.purpose, "status": "processed", "status_details": None, "expires_at": f.expires_at,
    }  # fmt: skip


def _query_int(q, name: str, default: int) -> int:
    v = q.get(name)
    if v is None:
        return default
    if not v.isdigit() or int(v) < 1:
        raise ApiError(400, f"{name}: expected a positive integer, got {v!r}", param=name)
    return int(v)


async def _prepare(
    pool: FairPool, tenant: str, converter: Converter, api: str, raw: bytes, identity: str
) -> Prepared:
    """`converter.prepare` on the `prepare` pool; if the client leaves meanwhile, a job not yet started
    is dropped, a started one finishes and the leases its result holds are released then (no file
    stays referenced by a gone request)."""
    job = pool.submit(tenant, converter.prepare, api, raw, identity)
    try:
        return await asyncio.shield(asyncio.wrap_future(job))
    except asyncio.CancelledError:
        if not job.cancel():  # started: release what it holds once it is done

            def release(done) -> None:
                if not done.cancelled() and done.exception() is None:
                    done.result().release()

            job.add_done_callback(release)
        raise


def _tokenizer_file(tokenizer):
    """The tokenizer.json behind a serving tokenizer (`ModelTokenizer.tokenizer_file`); None if none."""
    return getattr(tokenizer, "tokenizer_file", None)


async def _keepalive(work: asyncio.Future, interval: float, body: asyncio.Future):
    """An empty line every `interval` seconds until `work` is done, then the `body` future's bytes
    (`_finish`, which releases the request however it ends). Closed early (the client left), the work
    is cancelled."""
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=interval)
            if done:
                break
            yield b"\n"
        yield await body
    finally:
        if not body.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await body


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


async def _unless_disconnected(request: Request, work: asyncio.Future, patience: float | None = None):
    """`work`'s result, or cancel it (its `finally` aborts the engine request) if the client leaves;
    None (the work goes on) when it is not done within `patience` seconds."""
    deadline = None if patience is None else time.monotonic() + patience
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=_DISCONNECT_POLL_S)
            if done:
                return work.result()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if await request.is_disconnected():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                raise ApiError(499, "client closed the request")
    except BaseException:
        if not work.done():
            work.cancel()
        raise
