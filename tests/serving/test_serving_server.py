"""The gRPC server over a real localhost connection, with the mock engine and the real sampler."""

import asyncio
import math
import socket
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serving_helpers import ServerThread, make_engine_and_config, wait_until

from serving import client
from serving.grpc_service import SERVICE_NAME
from serving.proto import ced_pb2, ced_pb2_grpc
from serving.server import PortUnavailable, Server
from serving.testing.mock_engine import ByteTokenizer, mock_greedy_stream

pytestmark = pytest.mark.timeout(60)

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def srv():
    engine, cfg = make_engine_and_config(max_queued=2, metrics_port=0)
    st = ServerThread(engine, TOK, cfg)
    st.engine = engine
    yield st
    st.close()


@pytest.fixture
def slow(srv):
    """Makes every engine step take 20 ms for the duration of a test."""
    srv.engine.step_delay_s = 0.02
    yield srv
    srv.engine.step_delay_s = 0.0


def _stub(addr):
    channel = grpc.insecure_channel(addr)
    return channel, ced_pb2_grpc.InferenceServiceStub(channel)


def test_generate_streams_text_prompt(srv):
    prompt = "stream me"
    out = client.generate(srv.addr, prompt, max_tokens=12, temperature=0.0, timeout=10)
    want = mock_greedy_stream(TOK.encode(prompt), 12)
    assert out.token_ids == want and out.text == TOK.decode(want)
    assert out.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 12)
    assert out.messages >= 2  # streamed, not one blob
    srv.assert_idle()


def test_generate_token_ids_prompt_and_logprobs(srv):
    ids = TOK.encode("by ids")
    out = client.generate(srv.addr, ids, max_tokens=5, temperature=0.0, logprobs=2, timeout=10)
    assert out.token_ids == mock_greedy_stream(ids, 5)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id for lp in out.logprobs)


def test_stop_string_across_token_boundaries(srv):
    prompt = "stop test"
    full = TOK.decode(mock_greedy_stream(TOK.encode(prompt), 30))
    stop = full[7:10]
    out = client.generate(srv.addr, prompt, max_tokens=30, temperature=0.0, stop=[stop], timeout=10)
    assert out.text == full[: full.index(stop)] and stop not in out.text
    assert out.finish_reason == "stop" and TOK.decode(out.token_ids) == out.text


def test_tokenize_model_info_health_reflection(srv):
    assert client.tokenize(srv.addr, "héllo") == TOK.encode("héllo")
    info = client.model_info(srv.addr)
    assert info.model_name == "mock" and info.limits.max_context == 64 and info.limits.max_tokens == 60
    assert (
        info.limits.max_slots == 4
        and info.limits.max_queued == 2
        and list(info.prefill_buckets) == [4, 8, 16]
    )
    assert list(info.eos_token_ids) == [TOK.EOS] and info.config["kind"] == "mock"
    with grpc.insecure_channel(srv.addr) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "ced.v1.InferenceService"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(ch)
        services = db.get_services()
        assert "ced.v1.InferenceService" in services and "grpc.health.v1.Health" in services
        method = db.FindFileContainingSymbol("ced.v1.InferenceService")
        assert method.package == "ced.v1"


def _invalid(srv, prompt="ok", **kw):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(srv.addr, prompt, timeout=10, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def test_invalid_arguments_name_the_field_or_limit(srv):
    assert "max_context" in _invalid(srv, prompt="x" * 64)
    assert "max_tokens = 60" in _invalid(srv, max_tokens=61)
    assert "max_tokens" in _invalid(srv, max_tokens=-2)
    assert "prompt" in _invalid(srv, prompt="")
    assert "prompt_token_ids" in _invalid(srv, prompt=[])
    assert "prompt_token_ids" in _invalid(srv, prompt=[1, 999])
    assert "sampling.temperature" in _invalid(srv, temperature=-1.0)
    assert "sampling.temperature" in _invalid(srv, temperature=math.nan)
    assert "sampling.top_p" in _invalid(srv, top_p=0.0)
    assert "sampling.top_p" in _invalid(srv, top_p=1.5)
    assert "sampling.top_k" in _invalid(srv, top_k=-1)
    assert "logprobs" in _invalid(srv, logprobs=6)
    assert "logprobs" in _invalid(srv, logprobs=-1)
    assert "stop" in _invalid(srv, stop=["a"] * 17)
    assert "stop_token_ids" in _invalid(srv, stop_token_ids=[-5])
    assert "request_id" in _invalid(srv, request_id="r" * 300)
    channel, stub = _stub(srv.addr)
    with channel, pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(ced_pb2.GenerateRequest(max_tokens=3), timeout=5))  # no prompt at all
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    srv.assert_idle()


def test_resource_exhausted_duplicate_id_and_abort(slow):
    srv = slow
    srv.engine.step_delay_s = 0.05  # the streams are aborted anyway; make them outlast a busy machine
    channel, stub = _stub(srv.addr)
    with channel:
        # 4 slots + 2 queued places; each stream would take 40 steps of 50 ms
        calls = [
            stub.Generate(client.build_request("busy", request_id=f"busy{i}", max_tokens=40), timeout=20)
            for i in range(6)
        ]
        wait_until(lambda: srv.scheduler.num_in_flight == 6)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(client.build_request("one more", max_tokens=2), timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_running + max_queued" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(client.build_request("dup", request_id="busy0", max_tokens=2), timeout=5))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        for i in range(6):
            assert client.abort(srv.addr, f"busy{i}")
        assert not client.abort(srv.addr, "no-such-request")
        for call in calls:
            msgs = list(call)
            assert msgs[-1].finish_reason == ced_pb2.FINISH_REASON_ABORT
            assert msgs[-1].usage.prompt_tokens == 4
    srv.assert_idle()


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_client_cancel_or_disconnect_frees_slot_and_pages(slow, how):
    srv = slow
    channel, stub = _stub(srv.addr)
    call = stub.Generate(client.build_request("cancel me please", max_tokens=50), timeout=20)
    first = next(call)
    second = next(call)
    assert first.token_ids or second.token_ids
    assert srv.scheduler.num_running == 1 and srv.scheduler.pool.num_referenced > 0
    if how == "cancel":
        call.cancel()
    channel.close()
    srv.assert_idle()
    assert srv.scheduler.num_waiting == 0


def test_deadline_exceeded_frees_resources(slow):
    srv = slow
    with pytest.raises(grpc.RpcError) as e:
        client.generate(srv.addr, "too slow", max_tokens=50, timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    srv.assert_idle()


def test_metrics_endpoint(srv):
    client.generate(srv.addr, "metrics please", max_tokens=4, temperature=0.0, timeout=10)
    srv.assert_idle()
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    for name in (
        "ced_time_to_first_token_seconds_bucket",
        "ced_time_per_output_token_seconds_bucket",
        "ced_queue_time_seconds_bucket",
        "ced_queue_depth",
        "ced_active_slots",
        "ced_kv_pages_used",
        "ced_kv_pages_free",
        "ced_prefix_cache_hit_rate",
        "ced_prefix_cache_hit_tokens_total",
        'ced_requests_finished_total{finish_reason="length"}',
        "ced_compiles_after_warmup 0.0",
    ):
        assert name in body, name


def test_same_tokens_alone_and_among_31_others():
    engine, cfg = make_engine_and_config(max_slots=32, num_pages=512, max_queued=0)
    srv = ServerThread(engine, TOK, cfg)
    try:
        target = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=20, seed=1234)

        async def run(prompts_kwargs):
            async def one(prompt, kw):
                return client.collect([m async for m in client.astream(srv.addr, prompt, timeout=30, **kw)])

            return await asyncio.gather(*(one(p, kw) for p, kw in prompts_kwargs))

        (alone,) = asyncio.run(run([("the target", target)]))
        others = [
            (
                f"other prompt {i}",
                dict(max_tokens=10 + i % 20, temperature=(i % 4) * 0.5, seed=i, top_k=i % 7),
            )
            for i in range(31)
        ]
        together = asyncio.run(run(others[:13] + [("the target", target)] + others[13:]))
        assert together[13].token_ids == alone.token_ids and together[13].text == alone.text
        assert len(alone.token_ids) == 24
        assert engine.max_active_seen >= 16  # they really shared decode steps
        assert engine.compiles_after_warmup == 0
        srv.assert_idle()
    finally:
        srv.close()


def test_client_cli_streams(srv, capsys):
    assert client.main([srv.addr, "--prompt", "cli", "--max-tokens", "5", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == TOK.decode(mock_greedy_stream(TOK.encode("cli"), 5))
    assert "finish_reason=length" in err and "completion_tokens=5" in err
    assert "logprobs[" not in err
    assert (
        client.main(
            [srv.addr, "--prompt", "cli", "--max-tokens", "3", "--temperature", "0", "--logprobs", "2"]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("logprobs[")]
    expected = client.generate(srv.addr, "cli", max_tokens=3, temperature=0.0, logprobs=2)
    assert len(lines) == len(expected.logprobs) == 3
    for i, (line, lp) in enumerate(zip(lines, expected.logprobs, strict=True)):
        top = " ".join(f"{t.token_id}:{t.logprob:.6g}" for t in lp.top)
        assert (
            len(lp.top) == 2
            and line == f"logprobs[{i}] token={lp.token_id} logprob={lp.logprob:.6g} top={top}"
        )


def test_graceful_shutdown_in_process_health_and_abort():
    engine, cfg = make_engine_and_config(step_delay_s=0.02)
    srv = ServerThread(engine, TOK, cfg)
    channel, stub = _stub(srv.addr)
    with channel:
        call = stub.Generate(client.build_request("long one", max_tokens=55, temperature=0.0), timeout=20)
        next(call)
        done = asyncio.run_coroutine_threadsafe(srv.server.shutdown(grace_period_s=0.3), srv.loop)
        health = health_pb2_grpc.HealthStub(channel)
        wait_until(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(client.build_request("late", max_tokens=2), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        msgs = list(call)
        assert msgs[-1].finish_reason == ced_pb2.FINISH_REASON_ABORT
        done.result(10)
    assert srv.scheduler.pool.num_referenced == 0
    srv.stop_loop()


# ---- start-up: ports first, then warm-up ---------------------------------------------------------------


class LoopThread:
    """An event loop on its own thread, for a Server driven phase by phase."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float = 30.0):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _new_server(cfg):
    return Server(cfg)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def test_a_second_server_on_a_busy_grpc_port_is_refused(srv):
    # gRPC's default SO_REUSEPORT would let this bind succeed and split connections between the two.
    _, cfg = make_engine_and_config(port=srv.server.port)
    with pytest.raises(PortUnavailable, match=f"--port: cannot listen on 127.0.0.1:{srv.server.port}"):
        srv.call(srv.call(_new_server(cfg)).bind())
    assert client.model_info(srv.addr).model_name == "mock"  # the first server is unaffected


def test_a_busy_metrics_port_is_refused_and_nothing_stays_bound():
    lt = LoopThread()
    with socket.create_server(("127.0.0.1", 0)) as holder:
        busy, grpc_port = holder.getsockname()[1], _free_port()
        _, cfg = make_engine_and_config(port=grpc_port, metrics_port=busy)
        try:
            with pytest.raises(PortUnavailable, match=f"--metrics-port: cannot listen on 127.0.0.1:{busy}"):
                lt.call(lt.call(_new_server(cfg)).bind())
        finally:
            lt.close()
    socket.create_server(("127.0.0.1", grpc_port)).close()  # the gRPC port was released


class SlowWarmupEngine:
    """The mock engine, whose warm-up lasts until the test sets `warmup_done`."""

    def __init__(self, engine):
        self._engine = engine
        self.warmup_done = threading.Event()
        self.warming = threading.Event()

    def warmup(self):
        self.warming.set()
        assert self.warmup_done.wait(30)
        self._engine.warmup()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_listening_during_warm_up_not_serving_then_serving():
    engine, cfg = make_engine_and_config()
    slow = SlowWarmupEngine(engine)
    lt = LoopThread()
    server = lt.call(_new_server(cfg))
    try:
        lt.call(server.bind())
        attached = lt.submit(server.attach(slow, TOK))
        assert slow.warming.wait(10)
        with grpc.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(name):
                return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

            assert status("") == status(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
            for call in (
                lambda: client.generate(server.address, "early", max_tokens=2, timeout=5),
                lambda: client.tokenize(server.address, "early"),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
            assert not attached.done()
            slow.warmup_done.set()
            attached.result(10)
            assert status("") == status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
            out = client.generate(server.address, "ready", max_tokens=3, temperature=0.0, timeout=10)
            assert out.token_ids == mock_greedy_stream(TOK.encode("ready"), 3)
    finally:
        slow.warmup_done.set()
        lt.call(server.shutdown(0.0))
        lt.close()


# ---- text limits, Tokenize's own pool, undecodable requests ------------------------------------------


def test_text_size_limits_name_the_field_and_limit():
    engine, cfg = make_engine_and_config(max_prompt_bytes=20, max_tokenize_bytes=30)
    st = ServerThread(engine, TOK, cfg)
    try:
        assert "prompt: has 22 bytes of UTF-8; the limit is max_prompt_bytes = 20" in _invalid(st, "é" * 11)
        assert client.generate(st.addr, "é" * 10, max_tokens=2, timeout=10).finish_reason == "length"
        assert client.tokenize(st.addr, "é" * 15) == TOK.encode("é" * 15)
        with pytest.raises(grpc.RpcError) as e:
            client.tokenize(st.addr, "é" * 16)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "text: has 32 bytes of UTF-8; the limit is max_tokenize_bytes = 30" in e.value.details()
        st.assert_idle()
    finally:
        st.close()


def test_each_method_receives_at_most_its_own_limit(srv):
    """Issue 33.6: every method accepted text limits + 16 images x 20 MiB (322 MiB), text-only models
    too. Now RESOURCE_EXHAUSTED before parsing, naming the method's limit: Tokenize at its text limit,
    Generate without the image term on a text-only model, Abort / GetModelInfo at 1 MiB."""
    huge = b"x" * (3 << 20)  # over each text limit (1 MiB) + 1 MiB of other fields, far under 322 MiB
    with grpc.insecure_channel(srv.addr, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = ced_pb2_grpc.InferenceServiceStub(ch)
        calls = {
            "TokenizeRequest": lambda: stub.Tokenize(ced_pb2.TokenizeRequest(text=huge.decode()), timeout=30),
            "GenerateRequest": lambda: list(
                stub.Generate(ced_pb2.GenerateRequest(request_id="big", prompt=huge.decode()), timeout=30)
            ),
            "AbortRequest": lambda: stub.Abort(ced_pb2.AbortRequest(request_id=huge.decode()), timeout=30),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, e.value.details())
            assert name in e.value.details() and "accepts at most" in e.value.details()
        assert stub.Tokenize(ced_pb2.TokenizeRequest(text="fine"), timeout=30).token_ids  # still serving
    srv.assert_idle()


class GatedTokenizer(ByteTokenizer):
    """Encodes a text of more than 100 characters only once `release` is set; counts the waiting calls."""

    def __init__(self):
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.waiting = 0
        self.most_waiting = 0

    def encode(self, text):
        if len(text) > 100:
            with self._lock:
                self.waiting += 1
                self.most_waiting = max(self.most_waiting, self.waiting)
            try:
                assert self.release.wait(30)
            finally:
                with self._lock:
                    self.waiting -= 1
        return super().encode(text)


def test_large_tokenize_calls_do_not_hold_up_generate():
    tok = GatedTokenizer()
    engine, cfg = make_engine_and_config(tokenize_workers=2)
    st = ServerThread(engine, tok, cfg)
    channel, stub = _stub(st.addr)
    try:
        # More blocked Tokenize calls than the default thread pool has workers (at most 32): had they
        # shared it with Generate's prompt tokenization, the small request below could not start.
        big = ["t" * 1000 + str(i) for i in range(40)]
        calls = [stub.Tokenize.future(ced_pb2.TokenizeRequest(text=t), timeout=60) for t in big]
        # One tenant (this client's address: no API keys) runs half the tokenize_workers at once.
        wait_until(lambda: tok.waiting == 1)
        out = client.generate(st.addr, "small", max_tokens=4, temperature=0.0, timeout=10)
        assert out.token_ids == mock_greedy_stream(TOK.encode("small"), 4)
        assert not any(c.done() for c in calls)  # every large call is still held
        assert tok.most_waiting == 1  # bounded: half the tokenize_workers, one tenant's share
        tok.release.set()
        assert [list(c.result(30).token_ids) for c in calls] == [TOK.encode(t) for t in big]
        assert tok.most_waiting == 1
    finally:
        tok.release.set()
        channel.close()
        st.close()


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2), written by hand so it can hold bad UTF-8."""
    assert len(payload) < 128  # one-byte length
    return bytes([number << 3 | 2, len(payload)]) + payload


def _raw_call(addr, method: str, data: bytes, streaming: bool):
    """Sends `data` as the request bytes, as a client that does not validate strings would."""
    with grpc.insecure_channel(addr) as ch:
        path = f"/{SERVICE_NAME}/{method}"
        if streaming:
            call = ch.unary_stream(
                path, request_serializer=bytes, response_deserializer=ced_pb2.GenerateResponse.FromString
            )
            return list(call(data, timeout=10))
        return ch.unary_unary(path, request_serializer=bytes, response_deserializer=lambda b: b)(
            data, timeout=10
        )


def test_invalid_utf8_is_invalid_argument_naming_the_field(srv):
    max_tokens_3 = bytes([4 << 3 | 0, 3])  # field 4 (max_tokens), varint 3
    msgs = _raw_call(srv.addr, "Generate", _field(2, b"hand made") + max_tokens_3, streaming=True)
    assert sum(len(m.token_ids) for m in msgs) == 3  # the hand-written encoding itself is right
    cases = [
        ("Generate", _field(2, b"caf\xc3") + max_tokens_3, "prompt: is not valid UTF-8"),
        ("Generate", _field(1, b"\xff") + _field(2, b"ok"), "request_id: is not valid UTF-8"),
        (
            "Generate",
            _field(2, b"ok") + _field(6, b"a") + _field(6, b"\xfe\xff"),
            "stop[1]: is not valid UTF-8",
        ),
        ("Tokenize", _field(1, b"\xed\xa0\x80"), "text: is not valid UTF-8"),  # a UTF-16 surrogate
        ("Abort", _field(1, b"id\x80"), "request_id: is not valid UTF-8"),
        ("Generate", _field(2, b"ok")[:-1], "request: not a valid ced.v1.GenerateRequest message"),
    ]
    for method, data, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(srv.addr, method, data, streaming=method == "Generate")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
        assert e.value.details().startswith(message), e.value.details()
    srv.assert_idle()
