"""Constrained decoding end to end: the tiny random-weight model in a `JaxEngine`, driven by the
scheduler (and once over localhost gRPC), with the masks applied inside the compiled programs.

Whatever the random model prefers, the output must match the constraint: JSON that validates against
the schema (checked by `jsonschema`), DSML tool calls that DeepSeek's format parser
(`ced_jax.chat.parse_completion`) reads back, with arguments that validate against the tool's
parameter schema. The schemas are bounded (maxLength, enums, small integer ranges, no additional
properties) so that a random model finishes within max_tokens; the checks are never loosened.
An unconstrained request decoded beside a constrained one gets the tokens it gets alone.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from serving_helpers import ServerThread, run_until_idle
from tokenizers import Tokenizer

import ced_jax
from ced_jax.chat import parse_completion
from serving.config import ServeConfig
from serving.constraints import OutputConstraint
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.engine.protocol import SamplingParams
from serving.errors import InvalidRequest
from serving.proto import ced_pb2, ced_pb2_grpc
from serving.requests import FinishReason, GenerationRequest
from serving.scheduling.scheduler import Scheduler

pytestmark = pytest.mark.timeout(900)

SLOTS, PAGE, CONTEXT, CHUNK = 4, 16, 512, 32
MAX_TOKENS = 400
GREEDY = SamplingParams(temperature=0.0)
CALLS_OPEN = "\n\n<｜DSML｜ calls>\n"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "score", "ok", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find records",
        "parameters": {
            "type": "object",
            "properties": {
                "ids": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 2,
                },
                "exact": {"type": "boolean"},
            },
            "required": ["ids", "exact"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, LOOKUP)}


def _config(**kw) -> ServeConfig:
    base = dict(
        max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,),
        max_tokens_limit=MAX_TOKENS, default_max_tokens=16, max_queued=16, metrics_port=None,
    )  # fmt: skip
    base.update(kw)
    return ServeConfig(**base)


@pytest.fixture(scope="module")
def model():
    return ced_jax.load("tiny")


@pytest.fixture(scope="module")
def engine(model):
    eng = JaxEngine(model, _config())
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def hf(model):
    return Tokenizer.from_file(str(model.tokenizer_path))


@pytest.fixture
def scheduler(engine, model):
    # No prefix cache: a request run twice is computed from scratch both times.
    sched = Scheduler(engine, ModelTokenizer(model), _config(enable_prefix_cache=False))
    yield sched
    assert sched.num_in_flight == 0 and sched.pool.num_referenced == 0


def _prompt(hf, text: str) -> tuple[int, ...]:
    """BOS + the rendered chat text (special tokens where they are spelled)."""
    return (0, *hf.encode(text, add_special_tokens=False).ids)


def _chat(hf, user: str, tail: str = "") -> tuple[int, ...]:
    return _prompt(hf, f"<｜User｜>{user}<｜Assistant｜></think>{tail}")


def _run(sched: Scheduler, reqs: list[GenerationRequest]) -> dict[str, tuple[list[int], object, list]]:
    """Submits all requests in one step, runs to idle: {id: (token ids, final event, logprobs)}."""
    events: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        sched.submit(r, events[r.request_id].append)
    run_until_idle(sched)
    out = {}
    for rid, evs in events.items():
        assert evs and evs[-1].final, rid
        out[rid] = ([t for e in evs for t in e.token_ids], evs[-1], [lp for e in evs for lp in e.logprobs])
    return out


def _text(hf, ids: list[int]) -> str:
    return hf.decode(ids, skip_special_tokens=False)


def _check_calls(hf, ids: list[int], names: set[str]) -> list[dict]:
    """Parses the calls block the prompt opened plus the generated ids; every call is one of `names`
    and its arguments validate against that tool's parameter schema."""
    message = parse_completion(CALLS_OPEN + _text(hf, ids), "chat")
    assert message["content"] == "" and message["tool_calls"]
    for call in message["tool_calls"]:
        fn = call["function"]
        assert fn["name"] in names
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    return message["tool_calls"]


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(temperature=1.0, seed=7)], ids=["greedy", "sampled"]
)
def test_json_schema_output_validates(scheduler, hf, sampling):
    prompt = _chat(hf, "Give name, score, ok and color as JSON.")
    c = OutputConstraint(kind="json_schema", json_schema=SCHEMA)
    req = GenerationRequest(
        request_id="j", prompt_token_ids=prompt, max_tokens=MAX_TOKENS, sampling=sampling, constraint=c
    )
    ids, final, _ = _run(scheduler, [req])["j"]
    assert final.finish_reason is FinishReason.STOP, _text(hf, ids)
    jsonschema.validate(json.loads(_text(hf, ids)), SCHEMA)


def test_without_the_constraint_the_model_writes_no_json(scheduler, hf):
    """The check above can fail: unconstrained, the random model's output is not valid JSON."""
    prompt = _chat(hf, "Give name, score, ok and color as JSON.")
    req = GenerationRequest(request_id="u", prompt_token_ids=prompt, max_tokens=40, sampling=GREEDY)
    ids, _, _ = _run(scheduler, [req])["u"]
    with pytest.raises(ValueError):
        json.loads(_text(hf, ids))


@pytest.mark.parametrize("seed", [None, 3, 11])
def test_tool_choice_required_gives_valid_dsml_calls(scheduler, hf, seed):
    """Greedy: one call (parallel_tool_calls false); sampled: one or two (max_tool_calls 2). Without a
    bound the random model goes on adding well-formed invokes until max_tokens."""
    prompt = _chat(hf, "Weather in Paris for 2 days?", CALLS_OPEN)
    c = OutputConstraint(
        kind="tool_calls", tools=[WEATHER, LOOKUP], parallel_tool_calls=seed is not None, max_tool_calls=2
    )
    sampling = GREEDY if seed is None else SamplingParams(temperature=1.0, seed=seed)
    req = GenerationRequest(
        request_id="t", prompt_token_ids=prompt, max_tokens=MAX_TOKENS, sampling=sampling, constraint=c
    )
    ids, final, _ = _run(scheduler, [req])["t"]
    assert final.finish_reason is FinishReason.STOP, _text(hf, ids)
    assert _text(hf, ids).endswith("</｜DSML｜ calls>")
    calls = _check_calls(hf, ids, {"get_weather", "lookup"})
    assert len(calls) == 1 if seed is None else 1 <= len(calls) <= 2


def test_named_tool_choice_calls_only_that_function(scheduler, hf):
    prompt = _chat(hf, "Find records 1 and 2.", CALLS_OPEN)
    c = OutputConstraint(kind="tool_calls", tools=[WEATHER, LOOKUP], tool_name="lookup", max_tool_calls=2)
    for seed in (1, 2):
        req = GenerationRequest(
            request_id=f"n{seed}", prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
            sampling=SamplingParams(temperature=1.0, seed=seed), constraint=c,
        )  # fmt: skip
        ids, final, _ = _run(scheduler, [req])[f"n{seed}"]
        assert final.finish_reason is FinishReason.STOP, _text(hf, ids)
        calls = _check_calls(hf, ids, {"lookup"})
        assert {call["function"]["name"] for call in calls} == {"lookup"}


def test_unconstrained_neighbour_is_unaffected(scheduler, engine, hf):
    """Same tokens and log-probabilities as alone, whether the neighbour is constrained or not."""
    plain = GenerationRequest(
        request_id="p", prompt_token_ids=_chat(hf, "Tell me a story."), max_tokens=24,
        sampling=SamplingParams(temperature=1.0, seed=5), ignore_eos=True, logprobs=2,
    )  # fmt: skip
    json_req = GenerationRequest(
        request_id="c", prompt_token_ids=_chat(hf, "JSON please."), max_tokens=MAX_TOKENS, sampling=GREEDY,
        constraint=OutputConstraint(kind="json_schema", json_schema=SCHEMA),
    )  # fmt: skip
    alone = _run(scheduler, [plain])["p"]
    both = _run(scheduler, [plain, json_req])
    assert both["p"][0] == alone[0]
    assert len(alone[2]) == 24 and both["p"][2] == alone[2]
    jsonschema.validate(json.loads(_text(hf, both["c"][0])), SCHEMA)
    # the constrained request really shared the decode steps with the plain one
    assert len(both["c"][0]) > 1
    assert engine.compiles_after_warmup == 0


def test_regex_starts_after_its_start_token(scheduler, hf):
    """Before `start_after_token` is generated the rows are unconstrained (the tokens are the free
    run's); from the token after it the output matches the regex (thinking mode: after </think>).
    The random model rarely writes </think>, so the start token is one it does write."""
    prompt = _chat(hf, "Yes or no?")
    free = GenerationRequest(
        request_id="f", prompt_token_ids=prompt, max_tokens=8, sampling=GREEDY, ignore_eos=True
    )
    free_ids, _, _ = _run(scheduler, [free])["f"]
    start = free_ids[2]
    cut = free_ids.index(start) + 1
    c = OutputConstraint(kind="regex", regex="(yes|no)!", start_after_token=start)
    req = GenerationRequest(
        request_id="r", prompt_token_ids=prompt, max_tokens=64, sampling=GREEDY, constraint=c
    )
    ids, final, _ = _run(scheduler, [req])["r"]
    assert ids[:cut] == free_ids[:cut]
    assert _text(hf, ids[cut:]) in ("yes!", "no!") and final.finish_reason is FinishReason.STOP


def test_a_constraint_the_tokenizer_cannot_serve_is_refused_at_submit(scheduler, hf):
    c = OutputConstraint(kind="regex", regex="a", start_after_token=512)  # vocab is 512
    req = GenerationRequest(request_id="b", prompt_token_ids=_chat(hf, "x"), constraint=c)
    with pytest.raises(InvalidRequest) as e:
        scheduler.submit(req, lambda ev: None)
    assert e.value.field == "constraint.start_after_token"


# ---- gRPC ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(engine, model):
    st = ServerThread(engine, ModelTokenizer(model), _config())
    yield st
    st.close()


def _generate(server, request: ced_pb2.GenerateRequest) -> tuple[list[int], int]:
    with grpc.insecure_channel(server.addr) as ch:
        msgs = list(ced_pb2_grpc.InferenceServiceStub(ch).Generate(request, timeout=600))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason


def test_grpc_json_schema_and_tool_calls(server, hf):
    req = ced_pb2.GenerateRequest(
        prompt_token_ids=ced_pb2.TokenIds(ids=_chat(hf, "JSON please.")), max_tokens=MAX_TOKENS,
        sampling=ced_pb2.SamplingParams(temperature=0.0),
        constraint=ced_pb2.OutputConstraint(json_schema=json.dumps(SCHEMA)),
    )  # fmt: skip
    ids, finish = _generate(server, req)
    assert finish == ced_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(_text(hf, ids)), SCHEMA)

    tc = ced_pb2.ToolCallConstraint(
        tools_json=json.dumps([WEATHER, LOOKUP]), name="get_weather", max_tool_calls=2
    )
    req = ced_pb2.GenerateRequest(
        prompt_token_ids=ced_pb2.TokenIds(ids=_chat(hf, "Weather?", CALLS_OPEN)), max_tokens=MAX_TOKENS,
        sampling=ced_pb2.SamplingParams(temperature=1.0, seed=4),
        constraint=ced_pb2.OutputConstraint(tool_calls=tc),
    )  # fmt: skip
    ids, finish = _generate(server, req)
    assert finish == ced_pb2.FINISH_REASON_STOP
    assert {c["function"]["name"] for c in _check_calls(hf, ids, {"get_weather"})} == {"get_weather"}
    server.assert_idle()


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (ced_pb2.OutputConstraint(regex="(a"), "constraint.regex"),
        (ced_pb2.OutputConstraint(json_schema='{"type": "nope"}'), "constraint.json_schema"),
        (
            ced_pb2.OutputConstraint(tool_calls=ced_pb2.ToolCallConstraint(tools_json="[1]")),
            "constraint.tool_calls.tools_json[0]",
        ),
        (ced_pb2.OutputConstraint(regex="a", start_after_token=100000), "constraint.start_after_token"),
    ],
)
def test_grpc_invalid_constraint_is_invalid_argument(server, constraint, field):
    req = ced_pb2.GenerateRequest(
        prompt_token_ids=ced_pb2.TokenIds(ids=[0, 5, 6]), max_tokens=4, constraint=constraint
    )
    with pytest.raises(grpc.RpcError) as e:
        _generate(server, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()


def test_client_command_regex(server, capsys):
    from serving import client

    rc = client.main([server.addr, "--prompt", "Yes or no?", "--regex", "(yes|no)!", "--temperature", "0",
                      "--max-tokens", "16", "--timeout", "300"])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip() in ("yes!", "no!") and "finish_reason=stop" in out.err
