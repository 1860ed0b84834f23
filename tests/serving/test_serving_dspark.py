"""DSpark speculative decoding in the serving stack (`ServeConfig.dspark`, `ced-jax serve --dspark K`).

First over the hand-computable mock engine (`serving.testing.mock_engine`: it writes every draft position
through the page tables, verifies drafts by sampling each position with the real sampler, and proposes
the greedy continuation with a wrong draft now and then): a speculative server must give exactly the
tokens of a plain one (greedy and seeded), stop, EOS and max_tokens apply per emitted token, pages are
never leaked, grammar masks truncate drafts, a prefix-cache hit is followed by speculative steps, and
the metrics move. Then over gRPC with the tiny model's DSpark stages (`JaxEngine`).
"""

from __future__ import annotations

import numpy as np
import pytest
from serving_helpers import request, run_until_idle

from serving.config import ServeConfig
from serving.engine.protocol import EngineSpec, SamplingParams
from serving.metrics import Metrics
from serving.requests import FinishReason
from serving.scheduling.scheduler import Scheduler
from serving.scheduling.streams import collect
from serving.testing.mock_engine import ByteTokenizer, MockEngine, MockRule, mock_greedy_stream

pytestmark = pytest.mark.timeout(120)

TOK = ByteTokenizer()
SHAPES = dict(max_slots=4, page_size=4, num_pages=96, max_context=64, prefill_buckets=(4, 8, 16))
PROMPTS = ["the quick brown fox", "jumps over", "a lazy dog and then some", "zz"]


def _sched(
    dspark=0, *, widths=(1, 2, 3, 4), miss_every=5, metrics=None, confidence=None, constraint_tok=None, **kw
):
    shapes = {**SHAPES, **{k: kw.pop(k) for k in list(kw) if k in SHAPES}}
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in ("rule", "replay_tokens")}
    engine = MockEngine(
        **shapes, max_logprobs=5, dspark_widths=widths, draft_miss_every=miss_every, **engine_kw
    )
    engine.warmup()
    cfg = ServeConfig(
        **shapes, max_logprobs=5, max_tokens_limit=60, default_max_tokens=16, max_queued=16,
        metrics_port=None, dspark=dspark, dspark_confidence=confidence, **kw,
    )  # fmt: skip
    extra = {} if constraint_tok is None else {"constraint_tokenizer": constraint_tok}
    return engine, Scheduler(engine, TOK, cfg, metrics, **extra)


def _run(sched, reqs):
    """Submits (rid, prompt, kwargs) requests, runs to idle; {rid: (ids, text, final event)}."""
    events = {}
    for rid, prompt, kw in reqs:
        events[rid] = []
        sched.submit(request(rid, prompt, **kw), events[rid].append)
    run_until_idle(sched)
    return {rid: collect(ev) for rid, ev in events.items()}


def _assert_clean(engine, sched):
    assert sched.num_running == 0 and sched.num_in_flight == 0
    assert sched.pool.num_referenced == 0
    assert sched.pool.num_free + sched.pool.num_cached == sched.pool.num_pages
    sched.pool.check_invariants()
    assert engine.compiles_after_warmup == 0


def _same(a, b):
    """Two runs' results agree token for token, in text, finish reason and completion_tokens."""
    assert a.keys() == b.keys()
    for rid in a:
        (ia, ta, la), (ib, tb, lb) = a[rid], b[rid]
        assert (ia, ta) == (ib, tb), rid
        assert la.finish_reason is lb.finish_reason, rid
        assert la.usage.completion_tokens == lb.usage.completion_tokens, rid


def _workload(**kw):
    return [(f"r{i}", p, {"max_tokens": 9 + 7 * i, **kw}) for i, p in enumerate(PROMPTS * 2)]


@pytest.mark.parametrize("replay", [0, 4])
def test_greedy_output_is_plain_decodings_with_several_tokens_per_step(replay):
    plain_engine, plain = _sched(0, replay_tokens=replay)
    engine, spec = _sched(4, replay_tokens=replay)
    want, got = _run(plain, _workload()), _run(spec, _workload())
    _same(want, got)
    for i, p in enumerate(PROMPTS * 2):  # and the mock's reference (max_tokens within max_context)
        n = min(9 + 7 * i, SHAPES["max_context"] - len(p))
        assert got[f"r{i}"][0] == mock_greedy_stream(TOK.encode(p), n)
    assert not plain_engine.draft_log  # K = 0: plain decode steps only
    emitted = [e for _, _, _, e in engine.draft_log]
    assert max(emitted) == 5 and min(emitted) == 1  # whole blocks accepted, and rejections
    assert engine.decode_steps < plain_engine.decode_steps
    assert sum(g[2].usage.accepted_draft_tokens for g in got.values()) > 0
    _assert_clean(engine, spec)


def test_seeded_sampling_is_plain_decodings():
    kw = {"sampling": SamplingParams(temperature=1.0, top_p=0.9, seed=1234)}
    _, plain = _sched(0)
    engine, spec = _sched(3)
    _same(_run(plain, _workload(**kw)), _run(spec, _workload(**kw)))
    assert any(e > 1 for _, _, _, e in engine.draft_log)
    _assert_clean(engine, spec)


def test_n_drafts_never_pass_max_tokens_and_start_at_zero_after_prefill():
    engine, sched = _sched(4, miss_every=0)  # every draft right: whole blocks
    reqs = [(f"m{n}", "hello there", {"max_tokens": n}) for n in range(1, 12)]
    got = _run(sched, reqs)
    for n in range(1, 12):
        ids, _, last = got[f"m{n}"]
        assert ids == mock_greedy_stream(TOK.encode("hello there"), n)
        assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens == n
    # Each request's rows: the first step after prefill verifies nothing; the drafts verified never
    # reach past max_tokens (so nothing is dropped for length): emitted tokens sum to max_tokens - 1.
    by_slot_steps = {}
    for slot, width, k, e in engine.draft_log:
        assert k <= width and e == k + 1
        by_slot_steps.setdefault(slot, []).append(k)
    assert all(steps[0] == 0 for steps in by_slot_steps.values())
    _assert_clean(engine, sched)


def _stream_with_multi_token_step(prompt, n):
    """A greedy stream and an index i > 1 of a token that a K = 4 run emits in the middle of a step."""
    engine, sched = _sched(4)
    ids = _run(sched, [("x", prompt, {"max_tokens": n})])["x"][0]
    pos, mids = 1, []
    for _, _, _, e in engine.draft_log:  # one request: the rows are its steps, in order
        mids += [pos + j for j in range(e - 1)]  # every emitted token but the step's last
        pos += e
    return ids, [i for i in mids if i >= 2 and ids[i] not in ids[:i]]


@pytest.mark.parametrize("how", ["stop_token_ids", "eos", "stop_string"])
def test_a_stop_in_the_middle_of_a_block_drops_the_rest(how):
    prompt = "stop here please"
    ids, mids = _stream_with_multi_token_step(prompt, 30)
    assert mids, "the workload must stop mid-block"
    i = mids[0]
    stop = ids[i]
    if how == "stop_token_ids":
        kw, rule = {"stop_token_ids": (stop,)}, MockRule()
    elif how == "eos":
        kw, rule = {}, MockRule(eos_id=stop)  # the mock's EOS is this token
    else:
        kw, rule = {"stop": (TOK.decode([stop]),)}, MockRule()
    results = []
    for k in (0, 4):
        engine, sched = _sched(k, rule=rule)
        results.append(_run(sched, [("s", prompt, {"max_tokens": 30, **kw})]))
        _assert_clean(engine, sched)
    _same(*results)
    got_ids, _, last = results[1]["s"]
    assert last.finish_reason is FinishReason.STOP
    assert got_ids == ids[:i]  # the stop token is never sent (nor the text of a stop string)
    assert last.usage.completion_tokens == i + 1


def test_pages_are_reserved_ahead_and_never_leak():
    # Requests that run to max_context: a block past it cannot be paged, so those steps narrow.
    _, plain = _sched(0)
    engine, sched = _sched(4, miss_every=0)
    long_prompt = "x" * 50  # 50 + 14 = max_context 64
    reqs = [("long", long_prompt, {"max_tokens": 40}), ("short", "ab", {"max_tokens": 13})]
    _same(_run(plain, reqs), _run(sched, reqs))
    widths = {w for _, w, _, _ in engine.draft_log}
    assert 4 in widths and len(widths) > 1  # narrowed near max_context
    _assert_clean(engine, sched)
    # Aborts mid-stream and a stream of queued requests: every page comes back.
    events = []
    for i in range(8):
        sched.submit(request(f"a{i}", PROMPTS[i % 4], max_tokens=40), events.append)
    for _ in range(6):
        sched.step()
    assert sched.pool.num_referenced > 0
    for i in range(0, 8, 2):
        sched.abort(f"a{i}")
    run_until_idle(sched)
    _assert_clean(engine, sched)


def test_reserved_pages_cover_the_draft_block():
    engine, sched = _sched(4)
    sched.submit(request("p", "abcdefg", max_tokens=5), lambda ev: None)  # 7 + 5 - 1 + 4 = 15 -> 4 pages
    sched.step()
    seq = next(s for s in sched._slots if s is not None)
    assert len(seq.pages) == 4
    run_until_idle(sched)
    _assert_clean(engine, sched)


def test_confidence_chooses_the_length_and_narrows_steps():
    metrics_fixed, metrics_conf = Metrics(), Metrics()
    e_fixed, fixed = _sched(4, miss_every=4, metrics=metrics_fixed)
    e_conf, conf = _sched(4, miss_every=4, metrics=metrics_conf, confidence=0.5)
    _same(_run(fixed, _workload()), _run(conf, _workload()))
    # The mock's confidence is +4 for right drafts and -4 for wrong ones: with T = 0.5 a row stops
    # before its first wrong draft (at least one), so far fewer drafts are rejected.
    rejected = lambda log: sum(k - (e - 1) for _, _, k, e in log)
    assert rejected(e_conf.draft_log) < rejected(e_fixed.draft_log) / 2
    assert {w for _, w, _, _ in e_conf.draft_log} > {4}  # narrower programs when every row wants fewer
    # A row verifies more than one draft only while they are all right (confidence +4 each).
    assert all(e == k + 1 for _, _, k, e in e_conf.draft_log if k > 1)
    _assert_clean(e_conf, conf)


def test_confident_length_is_the_engines_rule():
    from ced_jax.model.dspark import confident_prefix
    from serving.scheduling.speculation import confident_length

    conf = np.random.default_rng(3).normal(0.0, 3.0, (200, 4)).astype(np.float32)
    for t in (0.05, 0.3, 0.5, 0.9):
        want = confident_prefix(conf, t)
        assert [confident_length(row, t) for row in conf] == want.tolist()
        assert len(set(want.tolist())) > 1  # the threshold cuts at different lengths


def _value(metrics, name):
    return metrics.registry.get_sample_value(name) or 0.0


def test_metrics_move():
    metrics = Metrics()
    engine, sched = _sched(4, metrics=metrics)
    got = _run(sched, _workload())
    steps = _value(metrics, "ced_dspark_steps_total")
    proposed = _value(metrics, "ced_dspark_draft_tokens_proposed_total")
    accepted = _value(metrics, "ced_dspark_draft_tokens_accepted_total")
    assert steps == engine.decode_steps > 0
    assert proposed == sum(k for _, _, k, _ in engine.draft_log)
    assert 0 < accepted == sum(e - 1 for _, _, _, e in engine.draft_log) < proposed
    rows = len(engine.draft_log)
    assert _value(metrics, "ced_dspark_mean_accepted_length") == pytest.approx(accepted / rows)
    assert _value(metrics, "ced_dspark_accepted_length_count") == rows
    assert _value(metrics, "ced_decode_steps_per_output_token") == pytest.approx(rows / (rows + accepted))
    assert sum(g[2].usage.accepted_draft_tokens for g in got.values()) == accepted
    plain_metrics = Metrics()
    _run(_sched(0, metrics=plain_metrics)[1], _workload())
    assert _value(plain_metrics, "ced_decode_steps_per_output_token") == 1.0
    assert _value(plain_metrics, "ced_dspark_steps_total") == 0


@pytest.mark.parametrize("replay", [0, 4])
def test_prefix_cache_hit_then_speculative_decode(replay):
    _, plain = _sched(0, replay_tokens=replay)
    engine, sched = _sched(4, replay_tokens=replay)
    prompt = "a shared system prompt, then a question"
    reqs = [("cold", prompt, {"max_tokens": 20})]
    want = _run(plain, reqs)
    _same(want, _run(sched, reqs))
    warm = _run(sched, [("cold", prompt, {"max_tokens": 20})])
    _same(want, warm)
    assert warm["cold"][2].usage.cached_prompt_tokens > 0
    assert any(e > 1 for _, _, _, e in engine.draft_log[-5:])
    _assert_clean(engine, sched)


@pytest.fixture(scope="module")
def byte_constraint_tokenizer(tmp_path_factory):
    """llguidance's view of the mock's byte vocabulary (a byte-level BPE tokenizer.json, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from serving.constraints import ConstraintTokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> character map, which ByteLevel uses
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    vocab = {"<bos>": TOK.BOS, "<eos>": TOK.EOS, "<pad>": TOK.PAD}
    vocab.update({chars[b]: TOK.OFFSET + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    path = tmp_path_factory.mktemp("bytetok") / "tokenizer.json"
    tok.save(str(path))
    return ConstraintTokenizer(path, vocab_size=TOK.vocab_size, eos_token_ids=(TOK.EOS,))


def test_constraints_truncate_drafts_at_the_first_forbidden_one(byte_constraint_tokenizer):
    import re

    from serving.constraints import OutputConstraint

    regex = "(ab|cd|e[a-z])+q"
    kw = {"constraint": OutputConstraint(kind="regex", regex=regex), "max_tokens": 40}
    reqs = [("c0", "constrained", kw), ("c1", "other prompt", kw), ("u", "unconstrained", {"max_tokens": 30})]
    _, plain = _sched(0, constraint_tok=byte_constraint_tokenizer)
    engine, sched = _sched(4, miss_every=0, constraint_tok=byte_constraint_tokenizer)
    want, got = _run(plain, reqs), _run(sched, reqs)
    _same(want, got)
    for rid in ("c0", "c1"):
        assert re.fullmatch(regex, got[rid][1]) or got[rid][2].finish_reason is FinishReason.LENGTH
    assert got["u"][0] == mock_greedy_stream(TOK.encode("unconstrained"), 30)
    # The mock drafts the unconstrained greedy continuation, which the grammar mostly forbids: the
    # constrained rows verify fewer drafts than they have, the unconstrained row all 4 of them.
    short = [k for _, w, k, _ in engine.draft_log if 0 < k < 4]
    assert short
    _assert_clean(engine, sched)


def test_config_and_engine_checks_name_the_flag():
    with pytest.raises(ValueError, match=r"--dspark\b"):
        ServeConfig(**SHAPES, dspark=-1)
    with pytest.raises(ValueError, match="--dspark-confidence"):
        ServeConfig(**SHAPES, dspark=2, dspark_confidence=1.5)
    with pytest.raises(ValueError, match="needs dspark"):
        ServeConfig(**SHAPES, dspark_confidence=0.5)
    no_dspark = MockEngine(**SHAPES)
    with pytest.raises(ValueError, match="--dspark.*no DSpark"):
        ServeConfig(**SHAPES, dspark=2).check_engine(no_dspark.spec)
    fixed = MockEngine(**SHAPES, dspark_widths=(4,))
    with pytest.raises(ValueError, match="--dspark-confidence.*every draft width"):
        ServeConfig(**SHAPES, dspark=4, dspark_confidence=0.5).check_engine(fixed.spec)
    with pytest.raises(ValueError, match="dspark_widths"):
        EngineSpec(
            max_slots=1, page_size=4, num_pages=4, max_context=16, prefill_buckets=(4,), vocab_size=8,
            eos_token_ids=(1,), max_logprobs=1, dspark_widths=(3, 2), dspark_max_drafts=5,
        )  # fmt: skip


# ------------------------------------------------------------------ the tiny model over gRPC
TINY_SLOTS, TINY_PAGE, TINY_CONTEXT, TINY_CHUNK = 8, 16, 256, 32


@pytest.fixture(scope="module")
def tiny():
    import ced_jax

    return ced_jax.load("tiny")


def _tiny_server(model, k):
    from serving_helpers import ServerThread

    from serving.engine.jax_engine import JaxEngine, ModelTokenizer

    cfg = ServeConfig(
        max_slots=TINY_SLOTS, page_size=TINY_PAGE, max_context=TINY_CONTEXT, prefill_buckets=(TINY_CHUNK,),
        max_tokens_limit=200, default_max_tokens=16, max_queued=64, metrics_port=0, dspark=k,
    )  # fmt: skip
    engine = JaxEngine(model, cfg)
    engine.warmup()
    return ServerThread(engine, ModelTokenizer(model), cfg)


def _generate_all(addr, prompts, max_tokens, prefill_mode=None):
    from concurrent.futures import ThreadPoolExecutor

    from serving import client

    def one(prompt):
        return client.generate(
            addr, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600,
            prefill_mode=prefill_mode,
        )  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _scrape(server) -> dict[str, float]:
    import urllib.request

    port = server.server.metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in body.splitlines()
        if line and not line.startswith("#") and "{" not in line
    }


# Slow: two servers' warm-ups (every program of a plain and a speculative engine). Measured on 2
# shared cores (load ~8): 533 s with a cold compilation cache, 216 s with the persistent cache.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpc_tiny_speculative_greedy_equals_plain_decoding(tiny):
    """Many slots (more requests than slots), long greedy outputs: `dspark=4` gives the tokens of
    `dspark=0` token for token; then a prefix-cache hit followed by speculative steps, and CED
    prefills; no compiles after warm-up; the DSpark metrics move."""
    rng = np.random.default_rng(15)
    prompts = [[0, *rng.integers(3, 512, n - 1).tolist()] for n in (5, 17, 33, 40, 9, 64, 23, 50, 12, 30)]
    max_tokens = 120
    servers = {}
    try:
        for k in (0, 4):
            servers[k] = _tiny_server(tiny, k)
        out = {k: _generate_all(s.addr, prompts, max_tokens) for k, s in servers.items()}
        for i, (plain, spec) in enumerate(zip(out[0], out[4], strict=True)):
            assert len(plain.token_ids) == len(spec.token_ids) == max_tokens
            first = next(
                (j for j, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids, strict=True)) if a != b),
                None,
            )
            assert first is None, f"prompt {i}: the streams differ first at token {first}"
            assert plain.finish_reason == spec.finish_reason == "length"
        # A prefix-cache hit (the 64-token prompt's full pages), then speculative steps.
        again = _generate_all(servers[4].addr, [prompts[5]], max_tokens)[0]
        assert again.usage.cached_prompt_tokens >= 48
        assert list(again.token_ids) == list(out[0][5].token_ids)
        # CED prefill (the stages' context from the prompt's last window only): still plain greedy.
        ced = {k: _generate_all(s.addr, [prompts[5], prompts[7]], 60, "ced") for k, s in servers.items()}
        assert [c.token_ids for c in ced[4]] == [c.token_ids for c in ced[0]]
        m = _scrape(servers[4])
        assert m["ced_compiles_after_warmup"] == 0.0
        assert m["ced_dspark_steps_total"] > 0
        assert m["ced_dspark_draft_tokens_proposed_total"] > 0
        assert 0 <= m["ced_dspark_draft_tokens_accepted_total"] <= m["ced_dspark_draft_tokens_proposed_total"]
        per_token = m["ced_decode_steps_per_output_token"]
        accepted = m["ced_dspark_draft_tokens_accepted_total"]
        assert per_token <= 1.0 and (accepted == 0) == (per_token == 1.0)
        assert _scrape(servers[0])["ced_dspark_steps_total"] == 0
        for s in servers.values():
            s.assert_idle()
    finally:
        for s in servers.values():
            s.close()


def test_serve_dspark_flags_reach_the_config():
    from ced_cli.main import build_parser
    from ced_cli.serve import serve_config

    def options(*flags: str) -> ServeConfig:
        return serve_config(build_parser().parse_args(["serve", "tiny", "--max-context", "256", *flags]))

    default = options()
    assert (default.dspark, default.dspark_confidence) == (0, None)  # off by default
    cfg = options("--dspark", "3", "--dspark-confidence", "0.6")
    assert (cfg.dspark, cfg.dspark_confidence) == (3, 0.6)
    with pytest.raises(ValueError, match=r"--dspark\b"):
        options("--dspark", "-1")
    with pytest.raises(ValueError, match="--dspark-confidence"):
        options("--dspark", "2", "--dspark-confidence", "0")


def test_jax_engine_refuses_k_beyond_the_models_draft_block(tiny):
    from types import SimpleNamespace

    from serving.engine.jax_engine import JaxEngine

    shapes = dict(max_slots=8, page_size=16, max_context=64, prefill_buckets=(32,))
    block = tiny.cfg.dspark_block_size
    with pytest.raises(ValueError, match=rf"--dspark\) {block + 1}: at most .* {block}"):
        JaxEngine(tiny, ServeConfig(**shapes, dspark=block + 1))
    # A checkpoint without its mtp.* tensors (the check comes before anything is built).
    no_stages = SimpleNamespace(
        cfg=tiny.cfg, hasher=tiny.hasher, params={k: v for k, v in tiny.params.items() if k != "mtp"}
    )
    with pytest.raises(ValueError, match=r"--dspark\) 2: the model .* has no DSpark draft stages"):
        JaxEngine(no_stages, ServeConfig(**shapes, dspark=2))
