"""The server's life: ports, the gRPC (InferenceService, health, reflection), HTTP and metrics listeners,
the engine put behind them, and shutdown. The InferenceService itself is serving/grpc_service.py.

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
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.config import ServeConfig
from serving.engine.protocol import EngineProtocol
from serving.files import FileStore
from serving.grpc_service import SERVICE_NAME, InferenceServicer, add_inference_service, max_receive_bytes
from serving.metrics import Metrics, MetricsServer
from serving.scheduling.scheduler import Scheduler
from serving.tenants import server_interceptors
from serving.text import Tokenizer
from serving.vision import ImagePipeline, warm_vision_encoder
from serving.work_pools import WorkPools

log = logging.getLogger(__name__)


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


# ---- listening ------------------------------------------------------------------------------------


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
                ("grpc.max_receive_message_length", max_receive_bytes(cfg)),
            ],
        )
        add_inference_service(server, lambda: self.servicer)
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
