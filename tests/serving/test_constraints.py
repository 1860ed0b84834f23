"""Output constraints on the host: grammars, matchers and masks (serving/constraints.py), the sampler's
mask (ced_jax/sampling.py), the gRPC conversion, and the scheduler over the mock engine.

The tokenizer is the tiny model's (vocab 512, EOS 1, `｜DSML｜` id 12, `</think>` id 11); texts are
tokenized by HF `tokenizers`, independently of llguidance. DSML texts come from the golden parse cases
of the chat encoding (`/work/shared/golden/chat-encoding/cases.jsonl`, copied here).
"""

from __future__ import annotations

import json

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np
import pytest
from tokenizers import Tokenizer

from ced_jax.config import ASSETS
from ced_jax.engine import SamplingBatch
from ced_jax.sampling import jitted_sample
from serving.constraints import ConstraintError, ConstraintTokenizer, OutputConstraint, constraint_from_proto
from serving.errors import InvalidRequest
from serving.proto import ced_pb2
from serving.testing.mock_engine import ByteTokenizer

TOKENIZER = ASSETS / "tiny" / "tokenizer.json"
V, EOS, THINK_END, DSML = 512, 1, 11, 12

# q03_tool_single and q04_tool_multi_noeos, the part after "\n\n<｜DSML｜ calls>\n" (the prompt's).
Q03 = (
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)
Q04 = (
    '<｜DSML｜ invoke name="search">\n'
    '<｜DSML｜ parameter name="query" string="true">a b</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="filters" string="false">{"lang": "fr"}</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="calculator">\n'
    '<｜DSML｜ parameter name="expr" string="true">1+1</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)


def tool(name, properties, required):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


WEATHER = tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
SEARCH = tool(
    "search",
    {"query": {"type": "string"}, "filters": {"type": "object", "properties": {"lang": {"type": "string"}}}},
    ["query"],
)
END = "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
CALC = tool("calculator", {"expr": {"type": "string"}}, ["expr"])


@pytest.fixture(scope="module")
def ctok():
    return ConstraintTokenizer(TOKENIZER, vocab_size=V, eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def hf():
    return Tokenizer.from_file(str(TOKENIZER))


def ids(hf, text):
    return hf.encode(text, add_special_tokens=False).ids


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def run(ctok, constraint, tokens):
    """Feeds tokens; checks each one against the mask filled before it. Returns the matcher."""
    m = ctok.matcher(constraint)
    row = np.zeros(ctok.words, np.int32)
    for i, t in enumerate(tokens):
        m.fill(row)
        if t not in allowed(row):
            raise AssertionError(f"token {i} ({t}) not allowed by the mask")
        m.consume(t)
        assert m.error is None
    return m


def rejected(ctok, constraint, tokens) -> bool:
    """True if some token is outside the mask filled before it."""
    m = ctok.matcher(constraint)
    row = np.zeros(ctok.words, np.int32)
    for t in tokens:
        m.fill(row)
        if t not in allowed(row):
            return True
        m.consume(t)
    return False


# ---- the special tokens the grammars need --------------------------------------------------------


def test_tiny_tokenizer_special_ids(ctok, hf):
    assert ctok.token_id("｜DSML｜") == DSML == hf.token_to_id("｜DSML｜")
    assert ctok.token_id("</think>") == THINK_END
    assert ctok.words == 16 == -(-V // 32)


# ---- JSON schema / object / regex ----------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "score", "tags"],
    "additionalProperties": False,
}


def test_json_schema_accepts_a_valid_document_then_only_eos(ctok, hf):
    doc = {"name": "Ada", "score": 42, "tags": ["a"]}
    m = run(ctok, OutputConstraint(kind="json_schema", json_schema=SCHEMA), ids(hf, json.dumps(doc)))
    assert m.done and m.accepting
    row = np.zeros(ctok.words, np.int32)
    m.fill(row)
    assert allowed(row) == {EOS}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Ada", "score": 420, "tags": []}',  # maximum
        '{"name": "Adalovelace", "score": 1, "tags": []}',  # maxLength
        '{"name": "Ada", "score": 1, "tags": [], "x": 1}',  # additionalProperties
        '{"name": "Ada", "tags": []}',  # required
        '{"name":"Ada", "score": 1, "tags": []}',  # compact separators only
    ],
)
def test_json_schema_rejects_what_the_schema_forbids(ctok, hf, text):
    assert rejected(ctok, OutputConstraint(kind="json_schema", json_schema=SCHEMA), ids(hf, text))


def test_eos_only_where_the_grammar_may_end(ctok, hf):
    m = ctok.matcher(OutputConstraint(kind="regex", regex="[a-c]{2,3}"))
    row = np.zeros(ctok.words, np.int32)
    for t in ids(hf, "a"):
        m.consume(t)
    m.fill(row)
    assert EOS not in allowed(row)
    for t in ids(hf, "b"):
        m.consume(t)
    m.fill(row)
    assert EOS in allowed(row) and not m.done and m.accepting
    m.consume(EOS)
    assert m.done and m.error is None


def test_json_object_is_any_object(ctok, hf):
    c = OutputConstraint(kind="json_object")
    assert run(ctok, c, ids(hf, '{"a": [1, {"b": null}], "c": "d"}')).done
    assert rejected(ctok, c, ids(hf, "[1, 2]"))
    assert rejected(ctok, c, ids(hf, ' {"a": 1}'))  # no leading whitespace


def test_start_after_token_leaves_rows_unconstrained_until_it_but_for_eos(ctok, hf):
    """Before the start token any token may come but EOS: the output cannot end before its constrained
    part (a JSON answer in thinking mode that stopped inside the reasoning had empty content)."""
    c = OutputConstraint(kind="regex", regex="yes|no", start_after_token=THINK_END)
    m = ctok.matcher(c)
    row = np.zeros(ctok.words, np.int32)
    everything_but_eos = set(range(V)) - {EOS}
    for t in ids(hf, "some thoughts"):
        m.fill(row)
        assert allowed(row) == everything_but_eos
        m.consume(t)
    batched = np.zeros((2, ctok.words), np.int32)
    ctok.fill_masks([(m, 1)], batched)  # the scheduler's batched fill writes the same row
    assert allowed(batched[1]) == everything_but_eos
    m.fill(row)
    assert allowed(row) == everything_but_eos
    m.consume(THINK_END)
    for t in ids(hf, "yes"):
        m.fill(row)
        assert t in allowed(row) and len(allowed(row)) < V
        m.consume(t)
    assert m.accepting and m.error is None


# ---- DSML tool calls -----------------------------------------------------------------------------


def test_tool_calls_accept_the_golden_single_call_then_stop(ctok, hf):
    m = run(ctok, OutputConstraint(kind="tool_calls", tools=[WEATHER]), ids(hf, Q03))
    assert m.done  # nothing but EOS after </｜DSML｜ calls>


def test_tool_calls_accept_the_golden_two_calls(ctok, hf):
    c = OutputConstraint(kind="tool_calls", tools=[SEARCH, CALC])
    assert run(ctok, c, ids(hf, Q04)).done
    assert rejected(
        ctok, OutputConstraint(kind="tool_calls", tools=[SEARCH, CALC], max_tool_calls=1), ids(hf, Q04)
    )
    assert run(
        ctok, OutputConstraint(kind="tool_calls", tools=[SEARCH, CALC], max_tool_calls=2), ids(hf, Q04)
    ).done
    # one call only: the second invoke is refused
    assert rejected(
        ctok,
        OutputConstraint(kind="tool_calls", tools=[SEARCH, CALC], parallel_tool_calls=False),
        ids(hf, Q04),
    )


def test_named_tool_choice_allows_only_that_function(ctok, hf):
    only_calc = OutputConstraint(kind="tool_calls", tools=[SEARCH, CALC], tool_name="calculator")
    assert rejected(ctok, only_calc, ids(hf, Q04))  # starts with a search call
    calc_text = Q04[Q04.index('<｜DSML｜ invoke name="calculator">') :]
    assert run(ctok, only_calc, ids(hf, calc_text)).done


@pytest.mark.parametrize(
    "text",
    [
        # required parameter city missing
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n' + END,
        # days is an integer: JSON, not raw text
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="true">3</｜DSML｜ parameter>\n' + END,
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">"3"</｜DSML｜ parameter>\n' + END,
        # an unknown tool
        '<｜DSML｜ invoke name="get_time">\n' + END,
        # DSML spelled as text, not the special token
        '<|DSML| invoke name="get_weather">\n',
    ],
)
def test_tool_calls_reject_malformed_calls(ctok, hf, text):
    assert rejected(ctok, OutputConstraint(kind="tool_calls", tools=[WEATHER]), ids(hf, text))


def test_dsml_is_the_special_token_in_the_mask(ctok, hf):
    m = ctok.matcher(OutputConstraint(kind="tool_calls", tools=[WEATHER]))
    row = np.zeros(ctok.words, np.int32)
    m.consume(ids(hf, "<")[0])
    m.fill(row)
    assert allowed(row) == {DSML}


def test_raw_string_parameters_honour_their_string_schema(ctok, hf):
    t = tool(
        "pick",
        {"color": {"type": "string", "enum": ["red", "blue"]}, "note": {"type": "string", "maxLength": 3}},
        ["color", "note"],
    )
    c = OutputConstraint(kind="tool_calls", tools=[t])

    def call(color, note):
        return (
            '<｜DSML｜ invoke name="pick">\n'
            f'<｜DSML｜ parameter name="color" string="true">{color}</｜DSML｜ parameter>\n'
            f'<｜DSML｜ parameter name="note" string="true">{note}</｜DSML｜ parameter>\n'
            "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
        )

    assert run(ctok, c, ids(hf, call("blue", "ok!"))).done
    assert rejected(ctok, c, ids(hf, call("green", "ok")))
    assert rejected(ctok, c, ids(hf, call("red", "long")))


# ---- validation names the field --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(kind="xml"), "kind"),
        (dict(kind="regex", regex="a(b"), "regex"),
        (dict(kind="regex", regex=""), "regex"),
        (dict(kind="json_schema", json_schema={"type": "foo"}), "json_schema"),
        (dict(kind="json_schema", json_schema={"$ref": "#/$defs/missing"}), "json_schema"),
        (dict(kind="json_schema"), "json_schema"),
        (dict(kind="json_object", regex="a"), "regex"),
        (dict(kind="tool_calls"), "tools"),
        (
            dict(kind="tool_calls", tools=[{"type": "function", "function": {"name": "a b"}}]),
            "tools[0].function.name",
        ),
        (
            dict(kind="tool_calls", tools=[tool("f", {"x": {"type": "nope"}}, [])]),
            "tools[0].function.parameters.properties.x",
        ),
        (
            dict(kind="tool_calls", tools=[tool("f", {"x": {"type": "string"}}, ["y"])]),
            "tools[0].function.parameters.required",
        ),
        (dict(kind="tool_calls", tools=[WEATHER], tool_name="other"), "tool_name"),
        (dict(kind="tool_calls", tools=[WEATHER], max_tool_calls=0), "max_tool_calls"),
        (dict(kind="regex", regex="a", start_after_token=-1), "start_after_token"),
        # issue 33.7: these stopped llguidance mid-stream ("too many expressions constructed")
        (dict(kind="regex", regex="a{1000000}"), "regex"),
        (dict(kind="regex", regex="b(a{1000}){1000}"), "regex"),
        (dict(kind="regex", regex=r"\p{L}{300000}"), "regex"),  # Python's parser cannot read \p
        (
            dict(kind="json_schema", json_schema={"type": "string", "pattern": "^z{300000}$"}),
            "json_schema.pattern",
        ),
        (
            dict(kind="tool_calls", tools=[tool("f", {"x": {"type": "string", "pattern": "q{300000}"}}, [])]),
            "tools[0].function.parameters.properties.x.pattern",
        ),
    ],
)
def test_invalid_constraints_name_the_field(kwargs, field):
    with pytest.raises(ConstraintError) as e:
        OutputConstraint(**kwargs)
    assert e.value.field == field


def test_the_regex_limit_admits_what_llguidance_runs_and_refuses_what_it_cannot(ctok, hf):
    """MAX_REGEX_EXPANSION sits below the point where llguidance fails in the middle of a stream: a
    regex at the limit runs, one past its measured failure point (bypassing our check) errors within
    a few tokens. If llguidance lifts its limit, the second half fails and the limit can move."""
    from serving.constraints import MAX_REGEX_EXPANSION, ConstraintMatcher

    at_limit = OutputConstraint(kind="regex", regex=f"a{{{MAX_REGEX_EXPANSION}}}")
    run(ctok, at_limit, ids(hf, "a" * 200))
    past = llg.LLMatcher(ctok.lltok, llg.LLMatcher.grammar_from_regex("a{300000}"), log_level=0)
    m, row = ConstraintMatcher(past, None), np.zeros(ctok.words, np.int32)
    for t in ids(hf, "a" * 200):
        m.fill(row)
        if m.error is not None:
            break
        m.consume(t)
    assert m.error is not None and "too many expressions" in m.error


def test_from_recipe_kinds():
    assert OutputConstraint.from_recipe("json", "").kind == "json_object"
    c = OutputConstraint.from_recipe("json", json.dumps(SCHEMA), start_after_token=THINK_END)
    assert (c.kind, c.json_schema, c.start_after_token) == ("json_schema", SCHEMA, THINK_END)
    assert OutputConstraint.from_recipe("regex", "a+").regex == "a+"
    assert OutputConstraint.from_recipe("tool_call_required", json.dumps([WEATHER])).tools == (WEATHER,)
    c = OutputConstraint.from_recipe("tool_call_required", json.dumps([WEATHER]), parallel_tool_calls=False)
    assert c.parallel_tool_calls is False
    assert OutputConstraint.from_recipe("tool_call", json.dumps([WEATHER])) is None  # auto
    with pytest.raises(ConstraintError):
        OutputConstraint.from_recipe("json", "{not json")


# ---- gRPC conversion -------------------------------------------------------------------------------


def test_constraint_from_proto():
    req = ced_pb2.GenerateRequest
    pb = ced_pb2.OutputConstraint
    assert constraint_from_proto(req()) is None
    c = constraint_from_proto(req(constraint=pb(json_schema=json.dumps(SCHEMA), start_after_token=11)))
    assert (c.kind, c.json_schema, c.start_after_token) == ("json_schema", SCHEMA, 11)
    assert constraint_from_proto(req(constraint=pb(json_object=True))).kind == "json_object"
    assert constraint_from_proto(req(constraint=pb(regex="a+"))).regex == "a+"
    tc = ced_pb2.ToolCallConstraint(
        tools_json=json.dumps([WEATHER, CALC]), name="calculator", parallel_tool_calls=False
    )
    c = constraint_from_proto(req(constraint=pb(tool_calls=tc)))
    assert (c.kind, c.tools, c.tool_name, c.parallel_tool_calls) == (
        "tool_calls",
        (WEATHER, CALC),
        "calculator",
        False,
    )


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (ced_pb2.OutputConstraint(), "constraint.kind"),
        (ced_pb2.OutputConstraint(json_schema="{"), "constraint.json_schema"),
        (ced_pb2.OutputConstraint(json_schema='{"type": 3}'), "constraint.json_schema"),
        (ced_pb2.OutputConstraint(json_object=False), "constraint.json_object"),
        (ced_pb2.OutputConstraint(regex="("), "constraint.regex"),
        (ced_pb2.OutputConstraint(regex="a{1000000}"), "constraint.regex"),  # issue 33.7: INTERNAL before
        (
            ced_pb2.OutputConstraint(tool_calls=ced_pb2.ToolCallConstraint(tools_json="{}")),
            "constraint.tool_calls.tools_json",
        ),
        (
            ced_pb2.OutputConstraint(
                tool_calls=ced_pb2.ToolCallConstraint(tools_json=json.dumps([WEATHER]), name="x")
            ),
            "constraint.tool_calls.name",
        ),
        # issue 33.7: a RecursionError (gRPC UNKNOWN) and 5,000 tools (INTERNAL mid-stream) before
        (ced_pb2.OutputConstraint(json_schema="[" * 100_000 + "]" * 100_000), "constraint.json_schema"),
        (ced_pb2.OutputConstraint(json_schema='{"a": ' * 129 + "1" + "}" * 129), "constraint.json_schema"),
        (
            ced_pb2.OutputConstraint(
                tool_calls=ced_pb2.ToolCallConstraint(tools_json="[" * 5000 + "]" * 5000)
            ),
            "constraint.tool_calls.tools_json",
        ),
        (
            ced_pb2.OutputConstraint(
                tool_calls=ced_pb2.ToolCallConstraint(tools_json=json.dumps([WEATHER] * 5000))
            ),
            "constraint.tool_calls.tools_json",
        ),
    ],
)
def test_constraint_from_proto_errors_name_the_field(constraint, field):
    with pytest.raises(InvalidRequest) as e:
        constraint_from_proto(ced_pb2.GenerateRequest(constraint=constraint))
    assert e.value.field == field


# ---- the sampler's mask ------------------------------------------------------------------------------


def test_sampler_mask_matches_llguidance_and_keeps_raw_logprobs():
    rng = np.random.default_rng(0)
    B = 4
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    mask = rng.integers(-(2**31), 2**31, size=(B, V // 32), dtype=np.int64).astype(np.int32)
    mask[0] = -1  # unconstrained row
    mask[1] = 0
    mask[1, 3] = -(2**31)  # only token 127 (bit 31 of word 3)
    expect = logits.copy()
    llg_np.apply_token_bitmask_inplace(expect, mask)  # llguidance's own reference
    positions = np.arange(B, dtype=np.int32)
    zeros, ones = np.zeros(B, np.float32), np.ones(B, np.float32)
    top_k, seed = np.zeros(B, np.int32), np.arange(B, dtype=np.uint32)
    tok, lp, _, _ = (
        np.asarray(a) for a in jitted_sample(0)(logits, positions, zeros, ones, top_k, seed, mask)
    )
    np.testing.assert_array_equal(tok, np.argmax(expect, axis=-1))
    assert tok[1] == 127
    raw = logits - np.log(np.sum(np.exp(logits.astype(np.float64)), axis=-1, keepdims=True))
    np.testing.assert_allclose(lp, raw[np.arange(B), tok], rtol=1e-5, atol=1e-5)
    # sampled rows only draw allowed tokens; the all-ones row draws what it draws without a mask
    for s in range(20):
        temp = np.full(B, 2.0, np.float32)
        seeds = np.full(B, s, np.uint32)
        drawn = np.asarray(jitted_sample(0)(logits, positions, temp, ones, top_k, seeds, mask)[0])
        free = np.asarray(jitted_sample(0)(logits, positions, temp, ones, top_k, seeds)[0])
        assert all(np.isfinite(expect[r, drawn[r]]) for r in range(B))
        assert drawn[0] == free[0]


def test_mock_engine_applies_the_masks():
    from serving.engine.protocol import DecodeBatch, PrefillChunk, SamplingParams
    from serving.testing.mock_engine import MockEngine

    eng = MockEngine(max_slots=2, page_size=4, num_pages=8, max_context=16, prefill_buckets=(4,))
    eng.warmup()
    w = -(-eng.spec.vocab_size // 32)
    only = np.zeros(w, np.int32)
    only[200 // 32] = 1 << (200 % 32)  # token 200 only
    greedy = SamplingParams(temperature=0.0)
    chunk = dict(token_ids=np.array([5, 6, 7], np.int32), start_pos=0,
                 page_table=np.arange(4, dtype=np.int32), history=np.zeros(0, np.int32), sampling=greedy,
                 is_last_chunk=True)  # fmt: skip
    free = eng.prefill(PrefillChunk(slot=0, **chunk)).token.token_id
    chunk["page_table"] = np.arange(4, 8, dtype=np.int32)
    assert eng.prefill(PrefillChunk(slot=1, token_bitmask=only, **chunk)).token.token_id == 200 != free
    mask = np.full((2, w), -1, np.int32)
    mask[1] = only
    out = eng.decode(
        DecodeBatch(
            active=np.ones(2, bool), token_ids=np.array([free, 200], np.int32),
            positions=np.array([3, 3], np.int32),
            page_tables=np.stack([np.arange(4), np.arange(4, 8)]).astype(np.int32),
            sampling=SamplingBatch.broadcast(2, token_bitmask=mask),
        )
    )  # fmt: skip
    assert out.token_ids[1] == 200 and out.token_ids[0] != 200
    assert eng.compiles_after_warmup == 0


class _ScriptedMatcher:
    """A ConstraintMatcher stand-in: allows only `script[i]` as the i-th token; done after the script,
    or an error at token `fail_at`."""

    def __init__(self, script, fail_at=None):
        self.script, self.fail_at, self.i, self.error = list(script), fail_at, 0, None

    def fill(self, row):
        row[:] = 0
        t = self.script[self.i]
        row[t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def consume(self, token_id):
        if self.i == self.fail_at:
            self.error = "scripted failure"
        self.i += 1

    @property
    def done(self):
        return self.i == len(self.script)


class _ScriptedTokenizer:
    def __init__(self, **kw):
        self.kw = kw

    def matcher(self, constraint):
        return _ScriptedMatcher(**self.kw)

    def fill_masks(self, rows, bitmask):
        for m, r in rows:
            m.fill(bitmask[r])


def _mock_scheduler(**matcher_kw):
    from serving_helpers import make_engine_and_config

    from serving.scheduling.scheduler import Scheduler

    engine, cfg = make_engine_and_config()
    sched = Scheduler(engine, ByteTokenizer(), cfg, constraint_tokenizer=_ScriptedTokenizer(**matcher_kw))
    return engine, sched


def test_scheduler_masks_rows_finishes_when_done_and_frees_the_row():
    from serving_helpers import request, run_until_idle

    from serving.requests import FinishReason
    from serving.testing.mock_engine import mock_greedy_stream

    script = [ByteTokenizer.OFFSET + ord(c) for c in "ok!"]
    engine, sched = _mock_scheduler(script=script)
    c = OutputConstraint(kind="regex", regex="ok!")  # the scripted matcher stands in for its grammar
    events = {"c": [], "u": []}
    sched.submit(request("c", "hello", max_tokens=20, constraint=c), events["c"].append)
    sched.submit(request("u", "world", max_tokens=6, ignore_eos=True), events["u"].append)
    run_until_idle(sched)
    c_ids = [t for e in events["c"] for t in e.token_ids]
    assert c_ids == script and events["c"][-1].finish_reason is FinishReason.STOP
    u_ids = [t for e in events["u"] for t in e.token_ids]
    assert u_ids == mock_greedy_stream(ByteTokenizer().encode("world"), 6)  # the neighbour is unmasked
    assert (sched._bitmask == -1).all()  # released rows are unconstrained again


def test_scheduler_ends_a_request_whose_grammar_fails_with_an_error():
    from serving_helpers import request, run_until_idle

    script = [ByteTokenizer.OFFSET + ord(c) for c in "abcdef"]
    engine, sched = _mock_scheduler(script=script, fail_at=2)
    events = []
    sched.submit(
        request("c", "hello", max_tokens=20, constraint=OutputConstraint(kind="json_object")), events.append
    )
    run_until_idle(sched)
    assert events[-1].error is not None and "scripted failure" in events[-1].error
    assert events[-1].error_field == "constraint"  # the request's grammar, not the engine, failed
    assert events[-1].finish_reason is None and sched.num_in_flight == 0 and sched.pool.num_referenced == 0


def test_scheduler_without_a_constraint_tokenizer_refuses_constraints():
    from serving_helpers import make_engine_and_config, request

    from serving.scheduling.scheduler import Scheduler

    engine, cfg = make_engine_and_config()
    sched = Scheduler(engine, ByteTokenizer(), cfg)  # the byte tokenizer has no tokenizer.json
    with pytest.raises(InvalidRequest) as e:
        sched.submit(request("c", "x", constraint=OutputConstraint(kind="json_object")), lambda ev: None)
    assert e.value.field == "constraint"


def test_batched_fill_equals_row_fills(ctok, hf):
    """`fill_masks` (one parallel call) writes what `fill` writes row by row; inactive rows all but EOS."""
    cs = [
        OutputConstraint(kind="json_schema", json_schema=SCHEMA),
        OutputConstraint(kind="tool_calls", tools=[WEATHER]),
        OutputConstraint(kind="regex", regex="[a-c]+!"),
        OutputConstraint(kind="regex", regex="x", start_after_token=THINK_END),
    ]
    prefixes = ['{"name": "A', '<｜DSML｜ invoke name="get_weather">\n<', "ab", "thinking"]
    ms = [ctok.matcher(c) for c in cs]
    for m, p in zip(ms, prefixes, strict=True):
        for t in ids(hf, p):
            m.consume(t)
    batch = np.zeros((6, ctok.words), np.int32)
    ctok.fill_masks([(m, r) for r, m in zip((4, 0, 2, 5), ms, strict=True)], batch)
    for r, m in zip((4, 0, 2, 5), ms, strict=True):
        row = np.zeros(ctok.words, np.int32)
        m.fill(row)
        np.testing.assert_array_equal(batch[r], row)
    assert allowed(batch[5]) == set(range(V)) - {EOS} and (batch[[1, 3]] == 0).all()
    assert allowed(batch[0]) == {DSML}
