"""Property tests (hypothesis, fixed seed) over GenerateRequest / TokenizeRequest / AbortRequest fields,
against a real server over localhost gRPC with the mock engine.

Whatever the fields hold, the answer is a well-formed stream or a clean refusal whose message starts
with the field it is about (`field: problem`), never UNKNOWN or INTERNAL and never a hang (every call
has a deadline well above what the mock needs); afterwards nothing holds a slot or a page and the page
pool's invariants hold. Valid greedy requests stream exactly the mock's next-token rule.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_helpers import ServerThread, make_engine_and_config

from serving.proto import ced_pb2, ced_pb2_grpc
from serving.testing.mock_engine import ByteTokenizer, mock_greedy_stream

pytestmark = pytest.mark.timeout(300)

TOK = ByteTokenizer()
VOCAB = TOK.vocab_size
HANG_S = 20.0  # no valid request to the mock takes a fraction of this
# The `field` prefixes a refusal may start with (the proto's field paths).
FIELDS = {
    "prompt", "prompt_token_ids", "max_tokens", "sampling.temperature", "sampling.top_p", "sampling.top_k",
    "sampling.seed", "stop", "stop_token_ids", "logprobs", "request_id", "user", "text",
}  # fmt: skip
PROPERTY = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,  # the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,
)


@pytest.fixture(scope="module")
def srv():
    engine, cfg = make_engine_and_config(max_queued=8)
    st_ = ServerThread(engine, TOK, cfg)
    st_.channel = grpc.insecure_channel(st_.addr)
    st_.stub = ced_pb2_grpc.InferenceServiceStub(st_.channel)
    yield st_
    st_.channel.close()
    st_.close()


# ------------------------------------------------------------------------------ strategies
ANY_INT32 = st.integers(-(2**31), 2**31 - 1)
SMALL_OR_ANY = st.one_of(st.integers(-3, 70), ANY_INT32)
FLOAT32 = st.one_of(
    st.floats(width=32),  # includes nan, +-inf, subnormals, huge
    st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-30, 100.0, 100.5, math.nan, math.inf, -math.inf]),
)
TOKEN_ID = st.one_of(st.integers(0, VOCAB - 1), ANY_INT32)
TEXT = st.text(max_size=40)  # any code points (no lone surrogates: a client cannot send those)


WILD_FIELDS = (
    "request_id", "input", "max_tokens", "stop", "stop_token_ids", "logprobs", "temperature", "top_p",
    "top_k", "user",
)  # fmt: skip


@st.composite
def generate_requests(draw) -> ced_pb2.GenerateRequest:
    """Mostly valid fields with up to two drawn from anything the wire can carry (so that streams,
    deadlines and every kind of refusal all come up)."""
    wild = draw(st.sets(st.sampled_from(WILD_FIELDS), max_size=2))

    def pick(name, valid, anything):
        return draw(anything if name in wild else valid)

    req = ced_pb2.GenerateRequest(
        request_id=pick(
            "request_id",
            st.one_of(st.just(""), st.text(min_size=1, max_size=20)),
            st.one_of(st.text(max_size=20), st.text(min_size=250, max_size=300)),
        ),
        max_tokens=pick("max_tokens", st.integers(0, 30), SMALL_OR_ANY),
        stop=pick(
            "stop",
            st.lists(st.text(min_size=1, max_size=4), max_size=3),
            st.lists(st.one_of(st.text(max_size=4), st.text(min_size=250, max_size=300)), max_size=20),
        ),
        stop_token_ids=pick(
            "stop_token_ids", st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(TOKEN_ID)
        ),
        logprobs=pick("logprobs", st.integers(0, 5), SMALL_OR_ANY),
        ignore_eos=draw(st.booleans()),
    )
    which = draw(st.sampled_from(["text", "ids"] + (["none"] if "input" in wild else [])))
    if which == "text":
        # At most 4 bytes (tokens) per character: 15 characters always fit the 64-token context.
        req.prompt = pick(
            "input", st.text(min_size=1, max_size=15), st.one_of(TEXT, st.text(min_size=60, max_size=80))
        )
    elif which == "ids":
        req.prompt_token_ids.SetInParent()  # set even when empty: an empty list is its own case
        ids = pick(
            "input",
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
            st.lists(TOKEN_ID, max_size=70),
        )
        req.prompt_token_ids.ids.extend(ids)
    if draw(st.booleans()) or wild & {"temperature", "top_p", "top_k"}:
        sp = req.sampling
        sp.SetInParent()
        if draw(st.booleans()) or "temperature" in wild:
            sp.temperature = pick("temperature", st.floats(0.0, 2.0, width=32), FLOAT32)
        if draw(st.booleans()) or "top_p" in wild:
            sp.top_p = pick("top_p", st.floats(0.0625, 1.0, width=32), FLOAT32)
        sp.top_k = pick("top_k", st.integers(0, 50), SMALL_OR_ANY)
        if draw(st.booleans()):
            sp.seed = draw(st.integers(0, 2**32 - 1))
    if "user" in ced_pb2.GenerateRequest.DESCRIPTOR.fields_by_name:
        req.user = pick(
            "user",
            st.one_of(st.just(""), st.text(max_size=12)),
            st.one_of(st.text(max_size=12), st.text(min_size=257, max_size=300)),
        )
    return req


def _assert_clean_refusal(e: grpc.RpcError, deadline: float | None) -> None:
    code, details = e.code(), e.details() or ""
    event(f"{code.name} {details.split(':', 1)[0]}")  # --hypothesis-show-statistics: what was covered
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert deadline is not None and deadline < HANG_S, f"hang: no answer in {HANG_S} s"
        return
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (code, details)
    assert details.split(":", 1)[0] in FIELDS, f"{code.name} does not start with a field: {details!r}"


def _assert_idle(srv) -> None:
    srv.assert_idle()  # no request in flight, no slot, no referenced page; pool invariants hold


# ------------------------------------------------------------------------------ Generate
@settings(PROPERTY, max_examples=300)
@given(req=generate_requests(), deadline=st.one_of(st.none(), st.floats(0.001, 2.0)))
def test_generate_answers_a_stream_or_a_clean_refusal(srv, req, deadline):
    try:
        msgs = list(srv.stub.Generate(req, timeout=HANG_S if deadline is None else deadline))
    except grpc.RpcError as e:
        _assert_clean_refusal(e, deadline)
    else:
        event("OK")
        assert msgs, "an OK stream without messages"
        assert msgs[-1].finish_reason != ced_pb2.FINISH_REASON_UNSPECIFIED
        assert all(m.finish_reason == ced_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
        ids = [t for m in msgs for t in m.token_ids]
        assert all(0 <= t < VOCAB for t in ids)
        assert req.max_tokens <= 0 or len(ids) <= req.max_tokens
        if req.logprobs > 0:
            assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
            assert all(len(e.top) == req.logprobs for m in msgs for e in m.logprobs)
        text = "".join(m.text for m in msgs)
        assert not any(s and s in text for s in req.stop), (req.stop, text)
    _assert_idle(srv)


@st.composite
def valid_greedy_requests(draw) -> tuple[ced_pb2.GenerateRequest, list[int]]:
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    max_tokens = draw(st.integers(1, 60))
    req = ced_pb2.GenerateRequest(max_tokens=max_tokens, logprobs=draw(st.integers(0, 5)), ignore_eos=True)
    req.prompt_token_ids.ids.extend(prompt)
    req.sampling.temperature = 0.0
    return req, prompt


@PROPERTY
@given(case=valid_greedy_requests())
def test_valid_greedy_request_streams_the_mock_rule(srv, case):
    req, prompt = case
    msgs = list(srv.stub.Generate(req, timeout=HANG_S))
    n = min(req.max_tokens, 64 - len(prompt))  # the context (64) also ends a stream
    assert [t for m in msgs for t in m.token_ids] == mock_greedy_stream(prompt, n)
    assert msgs[-1].finish_reason == ced_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == n and msgs[-1].usage.prompt_tokens == len(prompt)
    _assert_idle(srv)


# ------------------------------------------------------------------------------ Tokenize, Abort
@PROPERTY
@given(text=st.one_of(st.text(max_size=200), st.text(min_size=2000, max_size=3000)))
def test_tokenize_any_text(srv, text):
    try:
        ids = list(srv.stub.Tokenize(ced_pb2.TokenizeRequest(text=text), timeout=HANG_S).token_ids)
    except grpc.RpcError as e:
        _assert_clean_refusal(e, None)
    else:
        assert ids == TOK.encode(text)


@PROPERTY
@given(
    request_id=st.one_of(st.just(""), st.text(max_size=20), st.text(min_size=300, max_size=400)),
    user=st.one_of(st.just(""), st.text(max_size=12), st.text(min_size=257, max_size=300)),
)
def test_abort_of_nothing_in_flight(srv, request_id, user):
    req = ced_pb2.AbortRequest(request_id=request_id)
    if "user" in ced_pb2.AbortRequest.DESCRIPTOR.fields_by_name:
        req.user = user
    try:
        found = srv.stub.Abort(req, timeout=HANG_S).found
    except grpc.RpcError as e:
        _assert_clean_refusal(e, None)
    else:
        assert found is False
    _assert_idle(srv)
