"""Tenant isolation over real localhost gRPC (mock engine): identities, prefix-cache scope, request-id
namespaces, Abort, API keys."""

import logging
import secrets
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serving_helpers import ServerThread, make_engine_and_config, wait_until

from serving import client
from serving.proto import ced_pb2, ced_pb2_grpc
from serving.tenants import ApiKeys
from serving.testing.mock_engine import ByteTokenizer, mock_greedy_stream

pytestmark = pytest.mark.timeout(60)

TOK = ByteTokenizer()
# 40 prompt tokens: the client B of the issue guesses 40 tokens of client A's prompt. With pages of 4
# tokens, the 9 full blocks before the block holding the last token (36 tokens) can come from the cache.
SECRET = "the system prompt of tenant A: be kind. "
assert len(TOK.encode(SECRET)) == 40
REUSABLE = 36


def _serve(**overrides):
    engine, cfg = make_engine_and_config(**overrides)
    st = ServerThread(engine, TOK, cfg)
    st.engine = engine
    return st


@pytest.fixture(scope="module")
def open_srv():
    """No API keys: the identity is the `user` field."""
    st = _serve(metrics_port=0)
    yield st
    st.close()


@pytest.fixture(scope="module")
def shared_srv():
    st = _serve(share_prefix_cache=True)
    yield st
    st.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Freshly drawn keys in a real key file: two named, one unnamed, a comment and a blank line."""
    k = {name: f"sk-{name}-{secrets.token_hex(16)}" for name in ("alice", "bob", "carol")}
    path = tmp_path_factory.mktemp("keys") / "api_keys"
    path.write_text(f"# tenants\n{k['alice']} alice\n\n  {k['bob']}   bob  \n{k['carol']}\n")
    k["path"] = str(path)
    return k


@pytest.fixture(scope="module")
def keyed_srv(keys):
    st = _serve(api_keys=ApiKeys.load(keys["path"]), metrics_port=0)
    yield st
    st.close()


@pytest.fixture
def slow_engine():
    """Makes engine steps of the servers a test uses take 20 ms, so streams stay in flight."""
    touched = []

    def slow(st):
        st.engine.step_delay_s = 0.02
        touched.append(st)
        return st

    yield slow
    for st in touched:
        st.engine.step_delay_s = 0.0


def _cached(addr, prompt, **kw):
    out = client.generate(addr, prompt, max_tokens=4, temperature=0.0, timeout=10, **kw)
    assert out.finish_reason == "length" and out.token_ids == mock_greedy_stream(TOK.encode(prompt), 4)
    return out.usage.cached_prompt_tokens


# ---- prefix cache ------------------------------------------------------------------------------


def test_user_cannot_learn_another_users_prefix(open_srv):
    prompt = SECRET
    assert _cached(open_srv.addr, prompt, user="alice") == 0
    assert _cached(open_srv.addr, prompt, user="alice") == REUSABLE  # positive control: A's repeat hits
    assert _cached(open_srv.addr, prompt, user="bob") == 0  # B's exact guess of A's prompt: no signal
    assert _cached(open_srv.addr, prompt) == 0  # anonymous is a scope of its own
    assert _cached(open_srv.addr, prompt, user="bob") == REUSABLE  # B's own cache works
    open_srv.assert_idle()


def test_shared_prefix_cache_reveals_across_users(shared_srv):
    prompt = SECRET.replace("A", "S")
    assert _cached(shared_srv.addr, prompt, user="alice") == 0
    assert _cached(shared_srv.addr, prompt, user="bob") == REUSABLE  # what sharing reveals
    shared_srv.assert_idle()


def test_api_key_decides_the_scope_not_the_user_field(keyed_srv, keys):
    prompt = SECRET.replace("A", "K")
    assert _cached(keyed_srv.addr, prompt, api_key=keys["alice"]) == 0
    assert _cached(keyed_srv.addr, prompt, api_key=keys["alice"]) == REUSABLE
    # bob claims to be alice in `user`: the key decides, so no hit
    assert _cached(keyed_srv.addr, prompt, api_key=keys["bob"], user="alice") == 0
    assert _cached(keyed_srv.addr, prompt, api_key=keys["carol"]) == 0  # the unnamed key is a tenant too
    keyed_srv.assert_idle()


# ---- request ids and Abort ---------------------------------------------------------------------


def _open_stream(stub, prompt, rid, max_tokens=40, metadata=None, **kw):
    """Starts a stream and waits for its first message, so the request is in flight."""
    call = stub.Generate(
        client.build_request(prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0, **kw),
        timeout=20,
        metadata=metadata,
    )
    return call, [next(call)]


def test_same_request_id_in_two_tenants_both_run(open_srv, slow_engine):
    srv = slow_engine(open_srv)
    with grpc.insecure_channel(srv.addr) as ch:
        stub = ced_pb2_grpc.InferenceServiceStub(ch)
        a, a_msgs = _open_stream(stub, "alpha", "job", user="alice")
        b, b_msgs = _open_stream(stub, "bravo", "job", user="bob")
        assert srv.scheduler.num_in_flight == 2
        with pytest.raises(grpc.RpcError) as e:  # a duplicate within one tenant is still refused
            _open_stream(stub, "again", "job", user="alice")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        for call, msgs, prompt in ((a, a_msgs, "alpha"), (b, b_msgs, "bravo")):
            out = client.collect(msgs + list(call))
            assert out.finish_reason == "length"
            assert out.token_ids == mock_greedy_stream(TOK.encode(prompt), 40)
            assert {m.request_id for m in msgs} == {"job"}
    srv.assert_idle()


def test_abort_from_another_tenant_is_refused(open_srv, slow_engine):
    srv = slow_engine(open_srv)
    with grpc.insecure_channel(srv.addr) as ch:
        stub = ced_pb2_grpc.InferenceServiceStub(ch)
        call, msgs = _open_stream(stub, "alpha", "victim", user="alice")
        assert not client.abort(srv.addr, "victim", user="bob")
        assert not client.abort(srv.addr, "victim")  # nor anonymously
        msgs.append(next(call))  # still streaming
        assert msgs[-1].finish_reason == ced_pb2.FINISH_REASON_UNSPECIFIED
        assert client.abort(srv.addr, "victim", user="alice")  # the owner can
        out = client.collect(msgs + list(call))
        assert out.finish_reason == "abort" and len(out.token_ids) < 40
    srv.assert_idle()


def test_abort_with_keys_acts_only_on_the_keys_tenant(keyed_srv, keys, slow_engine):
    srv = slow_engine(keyed_srv)
    with grpc.insecure_channel(srv.addr) as ch:
        stub = ced_pb2_grpc.InferenceServiceStub(ch)
        bearer = (("authorization", f"Bearer {keys['alice']}"),)
        call, msgs = _open_stream(stub, "alpha", "mine", metadata=bearer)
        # bob with his own key, even claiming alice's user name, does not reach alice's request
        assert not client.abort(srv.addr, "mine", user="alice", api_key=keys["bob"])
        msgs.append(next(call))
        assert msgs[-1].finish_reason == ced_pb2.FINISH_REASON_UNSPECIFIED
        assert client.abort(srv.addr, "mine", api_key=keys["alice"])
        assert client.collect(msgs + list(call)).finish_reason == "abort"
    srv.assert_idle()


def test_user_field_length_limit(open_srv):
    limit = client.model_info(open_srv.addr).limits.max_user_length
    assert limit == 256
    assert _cached(open_srv.addr, "ok", user="u" * limit) == 0
    for call in (
        lambda: client.generate(open_srv.addr, "ok", user="u" * (limit + 1), timeout=10),
        lambda: client.abort(open_srv.addr, "x", user="u" * (limit + 1)),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "user" in e.value.details() and "max_user_length = 256" in e.value.details()


# ---- API keys ----------------------------------------------------------------------------------

_CALLS = {
    "Generate": lambda stub, md: list(
        stub.Generate(client.build_request("hi", max_tokens=2), timeout=10, metadata=md)
    ),
    "Tokenize": lambda stub, md: stub.Tokenize(ced_pb2.TokenizeRequest(text="hi"), timeout=10, metadata=md),
    "GetModelInfo": lambda stub, md: stub.GetModelInfo(
        ced_pb2.GetModelInfoRequest(), timeout=10, metadata=md
    ),
    "Abort": lambda stub, md: stub.Abort(ced_pb2.AbortRequest(request_id="none"), timeout=10, metadata=md),
}


@pytest.mark.parametrize("method", sorted(_CALLS))
def test_api_key_required_on_every_rpc(keyed_srv, keys, method):
    wrong = f"sk-alice-{secrets.token_hex(16)}"
    refused = {
        "missing": None,
        "wrong bearer": (("authorization", f"Bearer {wrong}"),),
        "wrong x-api-key": (("x-api-key", wrong),),
        "not bearer": (("authorization", f"Basic {keys['alice']}"),),
        "keys differ": (("authorization", f"Bearer {keys['alice']}"), ("x-api-key", keys["bob"])),
    }
    accepted = {
        "bearer": (("authorization", f"Bearer {keys['alice']}"),),
        "bearer, any case": (("authorization", f"bearer {keys['bob']}"),),
        "x-api-key": (("x-api-key", keys["bob"]),),
        "both, the same key": (("authorization", f"Bearer {keys['carol']}"), ("x-api-key", keys["carol"])),
    }
    with grpc.insecure_channel(keyed_srv.addr) as ch:
        stub = ced_pb2_grpc.InferenceServiceStub(ch)
        for why, md in refused.items():
            with pytest.raises(grpc.RpcError) as e:
                _CALLS[method](stub, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
            assert wrong not in e.value.details() and keys["alice"] not in e.value.details()
        for why, md in accepted.items():
            try:
                _CALLS[method](stub, md)
            except grpc.RpcError as e:
                raise AssertionError(f"{why}: {e.code()} {e.details()}") from None
    keyed_srv.assert_idle()


def test_health_and_reflection_need_no_key(keyed_srv):
    with grpc.insecure_channel(keyed_srv.addr) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert "ced.v1.InferenceService" in ProtoReflectionDescriptorDatabase(ch).get_services()


def test_keys_never_appear_in_responses_logs_or_metrics(keyed_srv, keys, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    seen = []
    with grpc.insecure_channel(keyed_srv.addr) as ch:
        stub = ced_pb2_grpc.InferenceServiceStub(ch)
        for name in ("alice", "carol"):
            md = (("authorization", f"Bearer {keys[name]}"),)
            call = stub.Generate(client.build_request(SECRET, max_tokens=3), timeout=10, metadata=md)
            seen += [str(m) for m in call]
            seen += [str(call.initial_metadata()), str(call.trailing_metadata())]
            seen.append(str(stub.GetModelInfo(ced_pb2.GetModelInfoRequest(), timeout=10, metadata=md)))
            seen.append(str(stub.Abort(ced_pb2.AbortRequest(request_id="x"), timeout=10, metadata=md)))
        for md in (None, (("authorization", f"Bearer {keys['alice']}x"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(client.build_request("x", max_tokens=1), timeout=10, metadata=md))
            seen += [e.value.details(), str(e.value.trailing_metadata())]
    keyed_srv.assert_idle()
    metrics_url = f"http://127.0.0.1:{keyed_srv.server.metrics_port}/metrics"
    seen.append(urllib.request.urlopen(metrics_url, timeout=5).read().decode())
    seen.append(repr(keyed_srv.server.config))
    seen += [caplog.text, *capfd.readouterr()]
    text = "\n".join(seen)
    assert "ced_requests_finished_total" in text and "invalid API key" in text  # all of it was read
    for name in ("alice", "bob", "carol"):
        assert keys[name] not in text
        assert keys[name].split("-")[-1] not in text  # nor its random part alone


def test_client_cli_api_key_and_user(keyed_srv, open_srv, keys, capsys):
    args = [keyed_srv.addr, "--prompt", "cli", "--max-tokens", "3", "--temperature", "0"]
    assert client.main([*args, "--api-key", keys["alice"]]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == TOK.decode(mock_greedy_stream(TOK.encode("cli"), 3))
    assert "finish_reason=length" in err
    assert client.main(args) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    prompt = SECRET.replace("A", "C")
    args = [open_srv.addr, "--prompt", prompt, "--max-tokens", "2", "--temperature", "0"]
    for user, cached in (("dora", 0), ("dora", REUSABLE), ("erin", 0)):
        assert client.main([*args, "--user", user]) == 0
        assert f"cached_prompt_tokens={cached} " in capsys.readouterr().err


# ---- key files and the serve command -----------------------------------------------------------


def test_key_file_errors_name_the_line_never_the_key(tmp_path):
    secret = f"sk-{secrets.token_hex(16)}"
    cases = {
        "": "has no keys",
        "# only a comment\n\n": "has no keys",
        f"{secret} name extra\n": "line 1: expected 'KEY' or 'KEY NAME', got 3 fields",
        f"{secret} a\n# x\n{secret} b\n": "line 3: the same key is already on line 1",
        f"{secret}\u00e9 name\n": "line 1: a key must be printable ASCII",
    }
    for text, message in cases.items():
        path = tmp_path / "keys"
        path.write_text(text)
        with pytest.raises(ValueError) as e:
            ApiKeys.load(str(path))
        assert message in str(e.value) and str(path) in str(e.value)
        assert secret not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeys.load(str(tmp_path / "missing"))


def test_key_names_and_rotation(tmp_path):
    old, new, anon = (f"sk-{secrets.token_hex(8)}" for _ in range(3))
    path = tmp_path / "keys"
    path.write_text(f"{old} team\n{new} team\n{anon}\n")
    keys = ApiKeys.load(str(path))
    assert keys.identify(old) == keys.identify(new) == "team"  # two keys, one tenant (rotation)
    unnamed = keys.identify(anon)
    assert unnamed.startswith("key-") and anon not in unnamed and anon[3:] not in unnamed
    assert keys.identify(old + "x") is None and keys.identify(old[:-1]) is None
    assert old not in repr(keys) and "team" not in repr(keys)


def test_serve_cli_key_file_errors_exit_2_before_loading(tmp_path, capsys):
    from ced_cli.main import main

    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, message in ((tmp_path / "missing", "cannot read"), (empty, "has no keys")):
        assert main(["serve", "tiny", "--api-key-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--api-key-file" in err and message in err, err


def test_six_tenants_at_once_with_one_request_id(open_srv):
    """Six tenants send the same request id and prompt at once: each gets its own complete stream."""
    results = {}

    def run(user):
        results[user] = client.generate(
            open_srv.addr, SECRET, request_id="same", user=user, max_tokens=5, temperature=0.0, timeout=20
        )

    threads = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    want = mock_greedy_stream(TOK.encode(SECRET), 5)
    assert sorted(results) == [f"t{i}" for i in range(6)]
    assert all(r.finish_reason == "length" and r.token_ids == want for r in results.values())
    wait_until(lambda: open_srv.scheduler.num_in_flight == 0)
    open_srv.assert_idle()
