"""serving/scheduling/scheduler.py driven step by step against the hand-computable mock engine."""

import asyncio

import numpy as np
import pytest
from serving_helpers import GREEDY, make_engine_and_config, request, run_until_idle, wait_until

from serving.config import LONG_PREFILL_CHUNK, ServeConfig
from serving.engine.protocol import SamplingParams
from serving.errors import AdmissionError, InvalidRequest
from serving.metrics import Metrics
from serving.requests import FinishReason, StreamEvent, TokenLogprobs, Usage
from serving.scheduling.scheduler import Scheduler
from serving.scheduling.streams import RequestStream, collect
from serving.testing.mock_engine import ByteTokenizer, MockRule, mock_greedy_stream

pytestmark = pytest.mark.timeout(60)

TOK = ByteTokenizer()


def _sched(metrics=None, clock=None, **kw):
    engine, cfg = make_engine_and_config(**kw)
    extra = {} if clock is None else {"clock": clock}
    return engine, Scheduler(engine, TOK, cfg, metrics, **extra)


def _submit(sched, rid, prompt, **kw):
    events = []
    sched.submit(request(rid, prompt, **kw), events.append)
    return events


def _assert_clean(engine, sched):
    """No request holds a slot or a page."""
    assert sched.num_running == 0 and sched.num_waiting == 0 and sched.num_in_flight == 0
    assert sched.pool.num_referenced == 0
    assert sched.pool.num_free + sched.pool.num_cached == sched.pool.num_pages
    sched.pool.check_invariants()


def test_greedy_stream_matches_reference_with_chunked_prefill():
    engine, sched = _sched()
    prompt = TOK.encode("the quick brown fox jumps")  # 25 tokens: chunks of 16 and 9 (bucket 16)
    ev = _submit(sched, "a", prompt, max_tokens=12)
    run_until_idle(sched)
    ids, text, last = collect(ev)
    want = mock_greedy_stream(prompt, 12)
    assert ids == want and text == TOK.decode(want)
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.usage.prompt_tokens, last.usage.cached_prompt_tokens, last.usage.completion_tokens) == (
        25,
        0,
        12,
    )
    assert [(s, n, b) for _, s, n, b in engine.prefill_log] == [(0, 16, 16), (16, 9, 16)]
    assert engine.compiles_after_warmup == 0
    _assert_clean(engine, sched)


def test_context_limit_clamps_max_tokens():
    engine, sched = _sched()
    prompt = TOK.encode("x" * 60)  # max_context 64 leaves room for 4 tokens
    ev = _submit(sched, "a", prompt, max_tokens=50)
    run_until_idle(sched)
    ids, _, last = collect(ev)
    assert ids == mock_greedy_stream(prompt, 4) and last.finish_reason is FinishReason.LENGTH
    _assert_clean(engine, sched)


def test_eos_stop_token_ids_and_ignore_eos():
    rule = MockRule(eos_modulus=5)
    engine, sched = _sched(rule=rule)
    prompt = TOK.encode("abc")
    ref = mock_greedy_stream(prompt, 40, rule)
    first_eos = ref.index(rule.eos_id)
    ev = _submit(sched, "eos", prompt, max_tokens=40)
    ev2 = _submit(sched, "ign", prompt, max_tokens=40, ignore_eos=True)
    stop_tok = ref[2]
    ev3 = _submit(sched, "stoptok", prompt, max_tokens=40, stop_token_ids=(stop_tok,), ignore_eos=True)
    run_until_idle(sched)
    ids, _, last = collect(ev)
    assert ids == ref[:first_eos] and last.finish_reason is FinishReason.STOP
    assert last.usage.completion_tokens == first_eos + 1  # the EOS is counted, not sent
    ids, _, last = collect(ev2)
    assert last.finish_reason is FinishReason.LENGTH and len(ids) == 40
    assert ids == ref  # EOS streamed as a token (it has no text)
    ids, _, last = collect(ev3)
    assert ids == ref[: ref.index(stop_tok)] and last.finish_reason is FinishReason.STOP
    _assert_clean(engine, sched)


def test_stop_string_across_token_boundaries():
    engine, sched = _sched()
    prompt = TOK.encode("hello")
    full = TOK.decode(mock_greedy_stream(prompt, 30))
    stop = full[10:13]  # three tokens long
    cut = full.index(stop)
    ev = _submit(sched, "a", prompt, max_tokens=30, stop=(stop, "never-appears"))
    run_until_idle(sched)
    ids, text, last = collect(ev)
    assert text == full[:cut] and stop not in text
    assert TOK.decode(ids) == text and last.finish_reason is FinishReason.STOP
    assert all(stop not in e.text for e in ev)
    _assert_clean(engine, sched)


def test_logprobs():
    engine, sched = _sched()
    ev = _submit(sched, "a", "hi", max_tokens=4, logprobs=3)
    ev0 = _submit(sched, "b", "hi", max_tokens=4)
    run_until_idle(sched)
    ids, _, _ = collect(ev)
    lps = [lp for e in ev for lp in e.logprobs]
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the best is sampled
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert all(not e.logprobs for e in ev0)


def test_validation_names_fields_and_limits():
    engine, sched = _sched()
    bad = [
        (dict(prompt=()), "prompt"),
        (dict(prompt=[5] * 64), "max_context"),
        (dict(prompt=[300]), "prompt_token_ids"),
        (dict(max_tokens=61), "max_tokens = 60"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(logprobs=6), "max_logprobs"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    ]
    for kw, needle in bad:
        prompt = kw.pop("prompt", [5, 6])
        with pytest.raises(InvalidRequest, match=needle):
            sched.submit(request("x", prompt, **kw), lambda e: None)
    assert sched.num_in_flight == 0


def test_admission_limits_fifo_and_duplicates():
    engine, sched = _sched(max_running=2, max_queued=2)
    evs = [_submit(sched, f"r{i}", "abcdef", max_tokens=8) for i in range(4)]
    with pytest.raises(AdmissionError) as e:
        _submit(sched, "r4", "abc")
    assert e.value.kind == "queue_full"
    with pytest.raises(AdmissionError) as e:
        _submit(sched, "r0", "abc")
    assert e.value.kind == "duplicate_id"
    sched.step()
    assert sched.num_running == 2 and sched.num_waiting == 2
    run_until_idle(sched)
    assert all(collect(ev)[2].finish_reason is FinishReason.LENGTH for ev in evs)
    _assert_clean(engine, sched)


def test_head_of_line_waits_for_pages():
    # 16 pages of 4 tokens; each request reserves ceil((6 + 40 - 1) / 4) = 12 pages
    engine, sched = _sched(num_pages=16)
    a = _submit(sched, "a", "abcdef", max_tokens=40)
    b = _submit(sched, "b", "abcdeg", max_tokens=40)
    sched.step()
    assert sched.num_running == 1 and sched.num_waiting == 1
    run_until_idle(sched)
    assert collect(a)[0] == mock_greedy_stream(TOK.encode("abcdef"), 40)
    assert collect(b)[0] == mock_greedy_stream(TOK.encode("abcdeg"), 40)
    _assert_clean(engine, sched)


def test_abort_in_every_phase_frees_slot_and_pages():
    engine, sched = _sched(max_running=1)
    long_prompt = "y" * 40  # three chunks of prefill
    running = _submit(sched, "run", "abc", max_tokens=50)
    prefilling = _submit(sched, "pre", long_prompt, max_tokens=5)
    waiting = _submit(sched, "wait", "abc", max_tokens=5)
    for _ in range(3):
        sched.step()
    assert sched.abort("run") and sched.abort("wait")
    sched.step()  # "pre" is admitted and starts prefill in this step
    assert sched.abort("pre")
    assert not sched.abort("nope")
    run_until_idle(sched)
    for ev in (running, prefilling, waiting):
        assert ev[-1].finish_reason is FinishReason.ABORT
    assert len(collect(running)[0]) >= 1
    _assert_clean(engine, sched)


def test_deadline_expires_waiting_and_running_requests():
    now = [0.0]
    engine, sched = _sched(clock=lambda: now[0], max_running=1)
    a = _submit(sched, "a", "abc", max_tokens=50, deadline=1.0)
    b = _submit(sched, "b", "abc", max_tokens=50, deadline=0.5)
    sched.step()
    sched.step()
    now[0] = 0.7
    sched.step()
    assert b[-1].finish_reason is FinishReason.ABORT and b[-1].deadline_exceeded and sched.num_running == 1
    now[0] = 1.5
    run_until_idle(sched)
    assert a[-1].finish_reason is FinishReason.ABORT and 1 <= len(collect(a)[0]) < 50
    _assert_clean(engine, sched)


@pytest.mark.parametrize("overlap", [True, False])
def test_new_requests_join_between_decode_steps(overlap):
    engine, sched = _sched(overlap_schedule=overlap)
    a = _submit(sched, "a", "abc", max_tokens=20)
    for _ in range(5):
        sched.step()
    steps_before = engine.decode_steps
    b = _submit(sched, "b", "x" * 20, max_tokens=5)  # two prefill chunks
    sched.step()
    sched.step()
    # b was prefilled in two chunks while a kept decoding (one decode per step)
    assert engine.decode_steps == steps_before + 2
    # One token per step: the first from the prefill (the step's decode was dispatched before it),
    # then one decode per step; overlapped, a step's tokens reach the stream in the next step.
    assert len(collect(a)[0]) == (6 if overlap else 7)
    run_until_idle(sched)
    assert collect(a)[0] == mock_greedy_stream(TOK.encode("abc"), 20)
    assert collect(b)[0] == mock_greedy_stream(TOK.encode("x" * 20), 5)


def _batches(engine) -> list[list[tuple[int, int, int]]]:
    """The (slot, start, length) of the chunks of each prefill_batch call."""
    log, out = list(engine.prefill_log), []
    for slots in engine.prefill_batches:
        out.append([log.pop(0)[:3] for _ in slots])
    return out


def test_prefill_batches_several_requests_under_the_token_budget():
    engine, sched = _sched(max_slots=8, prefill_token_budget=24, prefill_rows=(2, 4), batch_invariant=False)
    streaming = _submit(sched, "s", "hi", max_tokens=40)
    sched.step()  # "s" is prefilled and decodes from now on: the budget bounds every prefill step
    engine.prefill_log.clear()
    engine.prefill_batches.clear()
    prompts = {"a": "x" * 10, "b": "y" * 30, "c": "abc", "d": "z" * 20}
    events = {rid: _submit(sched, rid, p, max_tokens=6) for rid, p in prompts.items()}
    run_until_idle(sched)
    batches = _batches(engine)
    # Step 1: a page each in turn, oldest first (a 4, b 4, c its 3, d 4), then a second page for a
    # and b (23 tokens); d's second page would pass the budget of 24.
    assert batches[0] == [(1, 0, 8), (2, 0, 8), (3, 0, 3), (4, 0, 4)]
    # Step 2: a's last 2 tokens, b 4 + 4 + 4, d 4 + 4 (= 22; b's fourth page would pass 24)
    assert batches[1] == [(1, 8, 2), (2, 8, 12), (4, 4, 8)]
    for batch in batches[:3]:  # "s" decodes for 40 steps: the budget holds throughout
        assert sum(n for _, _, n in batch) <= 24 and len(batch) <= 4
        for _, start, n in batch:
            assert start % 4 == 0 and n <= 16
    for rid, p in prompts.items():
        assert collect(events[rid])[0] == mock_greedy_stream(TOK.encode(p), 6)
    assert len(collect(streaming)[0]) == 40
    assert engine.compiles_after_warmup == 0
    _assert_clean(engine, sched)


def test_a_prompt_with_no_stream_decoding_takes_whole_chunks():
    """The budget bounds how long decoding streams wait; with none, a step takes every row's
    largest chunk (16 tokens here), so a long prompt alone goes in as few steps as it can."""
    engine, sched = _sched(prefill_token_budget=8)
    alone = _submit(sched, "long", "w" * 60, max_tokens=4)
    run_until_idle(sched)
    assert [n for _, _, n, _ in engine.prefill_log] == [16, 16, 16, 12]
    engine.prefill_log.clear()
    streaming = _submit(sched, "s", "hi", max_tokens=30)
    sched.step()
    beside = _submit(sched, "long2", "v" * 60, max_tokens=4)
    run_until_idle(sched)
    assert [n for s, _, n, _ in engine.prefill_log if s != 0][:7] == [8] * 7  # the budget, "s" decoding
    for events, prompt, n in ((alone, "w" * 60, 4), (beside, "v" * 60, 4), (streaming, "hi", 30)):
        assert collect(events)[0] == mock_greedy_stream(TOK.encode(prompt), n)
    _assert_clean(engine, sched)


def test_a_long_prompt_with_no_stream_decoding_goes_alone_in_long_chunks():
    """With a long-prompt program (EngineSpec.long_prefill_chunk), the oldest request's text prompt
    of more than a chunk goes alone in long chunks while nothing decodes; once a stream decodes, the
    budget bounds every step again, and a short prompt never takes the long program."""
    engine, sched = _sched(long_prefill_chunk=32, long_prefill_step=8, prefill_token_budget=8)
    alone = _submit(sched, "long", "w" * 60, max_tokens=4)
    queued = _submit(sched, "short", "v" * 12, max_tokens=4)
    sched.step()
    assert engine.prefill_batches == [(0,)] and engine.prefill_log == [(0, 0, 32, 32)]
    run_until_idle(sched)
    # "long" finishes alone (28 tokens left: above a chunk); "short" then goes in under the budget,
    # since "long" decodes by then.
    assert [(s, n) for s, _, n, _ in engine.prefill_log] == [(0, 32), (0, 28), (1, 8), (1, 4)]
    engine.prefill_log.clear()
    streaming = _submit(sched, "s", "hi", max_tokens=30)
    sched.step()
    beside = _submit(sched, "long2", "u" * 60, max_tokens=4)
    run_until_idle(sched)
    assert max(n for s, _, n, _ in engine.prefill_log if s != 0) <= 8  # the budget: "s" decodes
    for events, prompt, n in (
        (alone, "w" * 60, 4), (queued, "v" * 12, 4), (beside, "u" * 60, 4), (streaming, "hi", 30)
    ):  # fmt: skip
        assert collect(events)[0] == mock_greedy_stream(TOK.encode(prompt), n)
    _assert_clean(engine, sched)


def test_prefill_rows_bounds_the_requests_per_step():
    engine, sched = _sched(max_slots=8, prefill_rows=(2,), prefill_token_budget=64)
    events = [_submit(sched, str(i), "q" * 5, max_tokens=3) for i in range(5)]
    sched.step()
    assert engine.prefill_batches == [(0, 1)]  # two requests, though the budget holds all five
    run_until_idle(sched)
    assert [len(b) for b in engine.prefill_batches] == [2, 2, 1]
    assert all(collect(ev)[0] == mock_greedy_stream(TOK.encode("q" * 5), 3) for ev in events)
    _assert_clean(engine, sched)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_dispatches_its_decode_before_its_prefill_and_streams_never_stall(overlap):
    engine, sched = _sched(prefill_token_budget=4, overlap_schedule=overlap)
    a = _submit(sched, "a", "abc", max_tokens=30)
    sched.step()  # a's prefill
    b = _submit(sched, "b", "w" * 40, max_tokens=3)  # ten steps of prefill at 4 tokens a step
    engine.calls.clear()
    for step in range(10):
        before = len(collect(a)[0])
        sched.step()
        # Overlapped, the first decode's token is taken in the next step, then one a step.
        got = 0 if overlap and step == 0 else 1
        assert len(collect(a)[0]) == before + got, f"step {step}: a stream stalled behind a prefill"
    assert engine.calls == ["decode", "prefill"] * 10
    run_until_idle(sched)
    assert collect(a)[0] == mock_greedy_stream(TOK.encode("abc"), 30)
    assert collect(b)[0] == mock_greedy_stream(TOK.encode("w" * 40), 3)
    _assert_clean(engine, sched)


def test_serve_config_prefill_knobs():
    cfg = ServeConfig(max_slots=32, page_size=16, max_context=256, prefill_buckets=(64,))
    assert cfg.prefill_rows == (4,) and cfg.prefill_token_budget == 128  # two pages of each of 4 rows
    assert ServeConfig(max_slots=2, page_size=16, max_context=256).prefill_rows == (2,)
    for bad, field in (
        (dict(prefill_rows=(4, 2)), "prefill_rows"),
        (dict(prefill_rows=(0, 4)), "prefill_rows"),
        (dict(prefill_rows=(8, 64)), "prefill_rows"),  # more rows than slots
        (dict(prefill_rows=()), "prefill_rows"),
        (dict(prefill_token_budget=15), "prefill_token_budget"),
        (dict(long_prefill_step=24), "long_prefill_step"),  # not a multiple of the page
        (dict(long_prefill_chunk=96, long_prefill_step=32), "long_prefill_chunk"),  # not above the chunk
        (dict(long_prefill_chunk=160, long_prefill_step=64), "long_prefill_chunk"),  # not of the step
        (dict(long_prefill_chunk=512, long_prefill_step=64), "long_prefill_chunk"),  # above max_context
    ):
        with pytest.raises(ValueError, match=field):
            ServeConfig(max_slots=32, page_size=16, max_context=256, prefill_buckets=(128,), **bad)
    # Auto: on from 4x LONG_PREFILL_CHUNK of context, off below (the extra compile would not pay).
    assert ServeConfig(max_context=4 * LONG_PREFILL_CHUNK).long_prefill_chunk == LONG_PREFILL_CHUNK
    assert ServeConfig(max_context=4 * LONG_PREFILL_CHUNK - 16).long_prefill_chunk == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="http_keepalive_s"):
            ServeConfig(http_keepalive_s=bad)


@pytest.mark.parametrize("replay", [0, 4, 8, 32])
def test_prefix_cache_hit_gives_cold_run_output(replay):
    """A hit of 20 tokens resumes at 20 - replay (pages mode at 20): the engine's ring is rebuilt
    from the replayed cached tokens (the mock's window is 4), so the output is the cold run's."""
    kw = dict(replay_tokens=replay, history_tokens=3)
    engine, sched = _sched(**kw)
    system = "you are a helpful bot. "  # 23 tokens
    p1, p2 = TOK.encode(system + "first"), TOK.encode(system + "second")
    sampling = SamplingParams(temperature=0.8, seed=11)
    _submit(sched, "a", p1, max_tokens=10, sampling=sampling)
    run_until_idle(sched)
    engine.prefill_log.clear()
    b = _submit(sched, "b", p2, max_tokens=10, sampling=sampling)
    run_until_idle(sched)
    assert engine.prefill_log[0][1] == max(0, 20 - replay)  # (slot, start, length, bucket)
    assert sum(n for _, _, n, _ in engine.prefill_log) == len(p2) - max(0, 20 - replay)
    # cold run of p2 on a fresh engine
    engine2, sched2 = _sched(**kw)
    c = _submit(sched2, "c", p2, max_tokens=10, sampling=sampling)
    run_until_idle(sched2)
    assert collect(b)[0] == collect(c)[0]
    # every shared full block is reused (20 of the 23 shared tokens), replayed or not
    assert collect(b)[2].usage.cached_prompt_tokens == 20
    assert collect(c)[2].usage.cached_prompt_tokens == 0
    _assert_clean(engine, sched)


def test_a_replay_shorter_than_the_engines_window_is_not_exact():
    """The mock's per-slot ring spans 8 tokens but the engine claims 4 of replay: a hit's ring holds
    only 4, so its output departs from the cold run's (the serving tests could see a short replay)."""
    rule = MockRule(window=8)
    engine, sched = _sched(replay_tokens=4, rule=rule)
    p = TOK.encode("abcdefghijklmnopqrstu")  # 21 tokens: a hit of 20
    outputs = []
    for rid in ("a", "b"):
        ev = _submit(sched, rid, p, max_tokens=6)
        run_until_idle(sched)
        outputs.append(collect(ev)[0])
    assert outputs[0] == mock_greedy_stream(p, 6, rule)
    assert outputs[1] != outputs[0]


@pytest.mark.parametrize("segment", [0, 3])
def test_randomized_workload_no_leaks_and_exact_outputs(segment):
    rng = np.random.default_rng(0)
    engine, sched = _sched(
        num_pages=40, max_slots=4, max_queued=6, replay_tokens=4, decode_segment_tokens=segment
    )
    prefixes = ["shared prefix one. ", "another shared prefix! "]
    events, prompts, aborted = {}, {}, set()
    n = 0
    for _ in range(400):
        op = rng.choice(["submit", "abort", "step", "step"])
        if op == "submit":
            prompt = TOK.encode(
                prefixes[rng.integers(2)][: rng.integers(0, 24)] + "q" * int(rng.integers(1, 9))
            )
            rid = f"r{n}"
            n += 1
            try:
                events[rid] = _submit(sched, rid, prompt, max_tokens=int(rng.integers(1, 20)))
                prompts[rid] = prompt
            except AdmissionError:
                pass
        elif op == "abort" and events:
            rid = list(events)[rng.integers(len(events))]
            if sched.abort(rid):
                aborted.add(rid)
        else:
            sched.step()
        sched.pool.check_invariants()
    run_until_idle(sched)
    _assert_clean(engine, sched)
    finished = 0
    for rid, ev in events.items():
        ids, _, last = collect(ev)
        assert last.finish_reason is not None
        if last.finish_reason is FinishReason.LENGTH:
            assert ids == mock_greedy_stream(prompts[rid], len(ids))
            finished += 1
        else:
            assert rid in aborted
    assert finished > 10 and sched.pool.evictions > 0
    assert engine.compiles_after_warmup == 0


def test_engine_failure_fails_streams_and_refuses_new_work():
    engine, sched = _sched()
    ev = _submit(sched, "a", "abc", max_tokens=10)

    def broken(batch):
        raise RuntimeError("device lost")

    engine.decode = broken
    sched.start()
    try:
        wait_until(lambda: ev and ev[-1].final)
        assert ev[-1].error and "device lost" in ev[-1].error
        with pytest.raises(AdmissionError) as e:
            _submit(sched, "b", "abc")
        assert e.value.kind == "engine_failed"
    finally:
        sched.shutdown()


def test_metrics_are_updated():
    metrics = Metrics()
    engine, sched = _sched(metrics=metrics)
    for rid in ("a", "b"):
        _submit(sched, rid, "shared prompt text", max_tokens=5)
        run_until_idle(sched)
    r = metrics.registry
    assert r.get_sample_value("ced_time_to_first_token_seconds_count") == 2
    assert r.get_sample_value("ced_time_per_output_token_seconds_count") == 2
    assert r.get_sample_value("ced_requests_finished_total", {"finish_reason": "length"}) == 2
    assert r.get_sample_value("ced_prefix_cache_hit_tokens_total") == 16
    assert r.get_sample_value("ced_prefix_cache_hit_rate") == pytest.approx(16 / 36)
    assert r.get_sample_value("ced_kv_pages_used") == 0
    assert r.get_sample_value("ced_compiles_after_warmup") == 0
    assert r.get_sample_value("ced_generation_tokens_total") == 10


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    assert GREEDY.temperature == 0.0


def test_request_ids_are_per_identity_and_abort_only_finds_own():
    engine, sched = _sched()
    a = _submit(sched, "r", "alpha", max_tokens=20, identity="alice")
    b = _submit(sched, "r", "bravo", max_tokens=20, identity="bob")  # the same id, another tenant
    with pytest.raises(AdmissionError) as e:
        _submit(sched, "r", "again", identity="alice")
    assert e.value.kind == "duplicate_id"
    sched.step()
    assert sched.num_running == 2
    assert not sched.abort("r", identity="mallory") and not sched.abort("r")  # not theirs
    sched.step()
    assert sched.abort("r", identity="bob")
    run_until_idle(sched)
    assert b[-1].finish_reason is FinishReason.ABORT
    assert collect(a)[2].finish_reason is FinishReason.LENGTH
    assert collect(a)[0] == mock_greedy_stream(TOK.encode("alpha"), 20)
    # once finished, the id is free again for its tenant
    c = _submit(sched, "r", "alpha", max_tokens=3, identity="alice")
    run_until_idle(sched)
    assert collect(c)[0] == mock_greedy_stream(TOK.encode("alpha"), 3)
    _assert_clean(engine, sched)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("replay", [0, 4])
def test_prefix_cache_is_scoped_per_identity_unless_shared(shared, replay):
    engine, sched = _sched(share_prefix_cache=shared, replay_tokens=replay)
    prompt = TOK.encode("a secret system prompt")  # 22 tokens: 5 full blocks, 20 tokens reusable

    def cached(rid, identity):
        ev = _submit(sched, rid, prompt, max_tokens=6, identity=identity)
        run_until_idle(sched)
        ids, _, last = collect(ev)
        assert ids == mock_greedy_stream(prompt, 6)  # a hit gives the cold run's tokens
        return last.usage.cached_prompt_tokens

    assert cached("a1", "alice") == 0
    assert cached("a2", "alice") == 20  # positive control: the owner's repeat hits
    assert cached("b1", "bob") == (20 if shared else 0)
    assert cached("anon", "") == (20 if shared else 0)
    if not shared:
        assert cached("b2", "bob") == 20  # bob's own copy now
    _assert_clean(engine, sched)


@pytest.mark.parametrize("shared", [False, True])
def test_randomized_tenants_no_leaks_exact_outputs_and_isolation(shared):
    """Three tenants, request ids reused within and across them, aborts by owners and by others."""
    rng = np.random.default_rng(1)
    engine, sched = _sched(num_pages=40, max_queued=6, replay_tokens=4, share_prefix_cache=shared)
    tenants = ["", "alice", "bob"]
    prefixes = ["shared prefix one. ", "another shared prefix! "]
    events, prompts, aborted = {}, {}, set()
    for n in range(500):
        op = rng.choice(["submit", "abort", "step", "step"])
        if op == "submit":
            who, rid = tenants[rng.integers(3)], f"r{rng.integers(8)}"
            text = prefixes[rng.integers(2)][: rng.integers(0, 24)] + "q" * int(rng.integers(1, 9))
            try:
                ev = _submit(sched, rid, TOK.encode(text), max_tokens=int(rng.integers(1, 20)), identity=who)
            except AdmissionError as e:
                assert e.kind in ("queue_full", "duplicate_id")
                continue
            events[(who, rid, n)] = ev
            prompts[(who, rid, n)] = TOK.encode(text)
        elif op == "abort" and events:
            rid, caller = f"r{rng.integers(8)}", tenants[rng.integers(3)]
            live = {key[:2] for key, ev in events.items() if not (ev and ev[-1].final)}
            if sched.abort(rid, identity=caller):
                assert (caller, rid) in live  # only ever the caller's own request
                aborted.add((caller, rid))
            else:
                assert (caller, rid) not in live
        else:
            sched.step()
        sched.pool.check_invariants()
    run_until_idle(sched)
    _assert_clean(engine, sched)
    finished = cross_tenant_hits = 0
    sent: list[tuple[str, list[int]]] = []  # (tenant, prompt) of every admitted request, in FIFO order
    for key, ev in events.items():
        who, rid, _ = key
        ids, _, last = collect(ev)
        if last.finish_reason is FinishReason.LENGTH:
            assert ids == mock_greedy_stream(prompts[key], len(ids))
            finished += 1
        else:
            assert last.finish_reason is FinishReason.ABORT and (who, rid) in aborted
        cached = last.usage.cached_prompt_tokens
        if cached:
            head = prompts[key][:cached]
            # Admission is FIFO, so a hit can only come from a request submitted earlier.
            own = any(w == who and p[:cached] == head for w, p in sent)
            assert own or shared, f"{who!r} hit a prefix only another tenant had sent"
            cross_tenant_hits += not own
        sent.append((who, prompts[key]))
    assert finished > 10 and sched.pool.evictions > 0
    assert (cross_tenant_hits > 0) == shared  # sharing does share (so the check above can fail)
    assert engine.compiles_after_warmup == 0


@pytest.mark.parametrize("replay_tokens", [0, 8])
def test_decode_segments_let_a_waiting_request_in_with_unchanged_outputs(replay_tokens):
    """One slot, two long requests: with decode_segment_tokens the second streams before the first
    finishes (they take turns), and both streams are token for token those of the same requests
    run without yielding (seeded sampling: the draw at a position does not depend on the segments)."""
    sampling = SamplingParams(temperature=0.8, seed=5)
    prompts = {"a": TOK.encode("the first long request"), "b": TOK.encode("second one")}

    def run(segment):
        metrics = Metrics()
        engine, sched = _sched(
            metrics=metrics, max_slots=1, replay_tokens=replay_tokens, decode_segment_tokens=segment
        )
        order = []  # (request, event) in the order the sinks saw them

        def sink(rid, events):
            return lambda ev: (events.append(ev), order.append((rid, ev)))

        events = {rid: [] for rid in prompts}
        for rid, prompt in prompts.items():
            sched.submit(request(rid, prompt, max_tokens=30, sampling=sampling), sink(rid, events[rid]))
        run_until_idle(sched)
        _assert_clean(engine, sched)
        yields = metrics.registry.get_sample_value("ced_decode_segment_yields_total")
        return {rid: collect(ev) for rid, ev in events.items()}, order, yields

    plain, plain_order, plain_yields = run(0)
    turns, turns_order, yields = run(8)
    for rid, prompt in prompts.items():
        assert len(plain[rid][0]) == 30
        assert turns[rid][0] == plain[rid][0] and turns[rid][1] == plain[rid][1]
        usage = turns[rid][2].usage
        counts = (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens)
        assert counts == (len(prompt), 0, 30)
    assert turns["b"][2].finish_reason is FinishReason.LENGTH

    def first_of_b_before_a_ends(order):
        b_first = next(i for i, (rid, ev) in enumerate(order) if rid == "b" and ev.token_ids)
        a_last = next(i for i, (rid, ev) in enumerate(order) if rid == "a" and ev.final)
        return b_first < a_last

    assert not first_of_b_before_a_ends(plain_order) and plain_yields == 0
    assert first_of_b_before_a_ends(turns_order)
    assert yields >= 3  # 30 tokens in segments of 8: a and b take turns several times


def test_decode_segments_do_not_yield_without_waiting_requests():
    metrics = Metrics()
    engine, sched = _sched(metrics=metrics, max_slots=2, decode_segment_tokens=2)
    evs = [_submit(sched, rid, "abc" + rid, max_tokens=20) for rid in ("a", "b")]
    run_until_idle(sched)
    for rid, ev in zip(("a", "b"), evs, strict=True):
        assert collect(ev)[0] == mock_greedy_stream(TOK.encode("abc" + rid), 20)
    assert metrics.registry.get_sample_value("ced_decode_segment_yields_total") == 0
    _assert_clean(engine, sched)


def test_a_finished_request_leaves_its_output_in_the_prefix_cache():
    """The next turn of a conversation (prompt + the reply + more) reuses the reply's blocks too, not
    only the first prompt's; an aborted request leaves only what its prefill registered."""
    engine, sched = _sched()
    prompt = TOK.encode("first turn of a chat")  # 20 tokens
    ev = _submit(sched, "t1", prompt, max_tokens=12)
    run_until_idle(sched)
    reply = collect(ev)[0]
    assert len(reply) == 12
    # KV exists for the prompt and the reply but its last token: positions 0..30, 7 full blocks
    turn2 = prompt + reply + TOK.encode(" and more")
    ev2 = _submit(sched, "t2", turn2, max_tokens=4)
    run_until_idle(sched)
    ids, _, last = collect(ev2)
    assert last.usage.cached_prompt_tokens == 28 and ids == mock_greedy_stream(turn2, 4)
    _assert_clean(engine, sched)


@pytest.mark.parametrize("overlap", [True, False])
def test_device_idle_between_steps_is_measured_only_while_there_is_work(overlap):
    metrics = Metrics()
    engine, sched = _sched(metrics, overlap_schedule=overlap)
    value = lambda name: metrics.registry.get_sample_value(name) or 0.0
    for round_ in range(2):
        events = _submit(sched, f"r{round_}", "abcdefgh", max_tokens=5)
        run_until_idle(sched)  # the last step() found nothing to do
        assert len(collect(events)[0]) == 5
        # One request: each engine call (one prefill, four decodes) is a busy spell of its own, timed;
        # each but the first of a round has a gap before it (the wait for work between rounds has none).
        assert engine.calls == ["prefill"] + ["decode"] * 4
        engine.calls.clear()
        assert value("ced_step_seconds_count") == 5 * (round_ + 1)
        assert value("ced_device_idle_between_steps_seconds_count") == 4 * (round_ + 1)
    assert 0 < value("ced_device_idle_between_steps_seconds_sum") < 5.0


def test_overlap_hands_a_steps_tokens_out_after_the_next_step_is_dispatched():
    engine, sched = _sched()
    log = []
    decode = engine.decode
    engine.decode = lambda batch: (log.append("decode"), decode(batch))[1]
    sched.submit(request("a", "abc", max_tokens=6), lambda ev: log.append(len(ev.token_ids)))
    run_until_idle(sched)
    # The prefill's token, then each decode's token only after the next decode was dispatched; the
    # last decode (its token ends the request) is followed by no other.
    assert log == [1, "decode", "decode", 1, "decode", 1, "decode", 1, "decode", 1, 1]
    _assert_clean(engine, sched)


def test_overlap_drops_the_rows_of_requests_that_left_their_slot_while_it_ran():
    """A stop string ends "a" after its next step was dispatched (its row there is dropped), an abort
    ends "b" likewise, and "c" and "d" take their slots at once: every stream equals its run alone."""
    metrics = Metrics()
    engine, sched = _sched(metrics, max_slots=2)
    prompt = TOK.encode("hello")
    full = TOK.decode(mock_greedy_stream(prompt, 30))
    stop = full[4:6]
    a = _submit(sched, "a", prompt, max_tokens=30, stop=(stop,))
    b = _submit(sched, "b", "xyz", max_tokens=30)
    c = _submit(sched, "c", "q" * 9, max_tokens=7)
    d = _submit(sched, "d", "abcd", max_tokens=5)
    for _ in range(6):
        sched.step()
    assert sched.abort("b")
    run_until_idle(sched)
    ids, text, last = collect(a)
    assert text == full[: full.index(stop)] and last.finish_reason is FinishReason.STOP
    assert b[-1].finish_reason is FinishReason.ABORT
    assert collect(b)[0] == mock_greedy_stream(TOK.encode("xyz"), 30)[: len(collect(b)[0])]
    assert collect(c)[0] == mock_greedy_stream(TOK.encode("q" * 9), 7)
    assert collect(d)[0] == mock_greedy_stream(TOK.encode("abcd"), 5)
    assert sched.overlap_dropped_rows == 2  # a's and b's rows of the step in flight when they ended
    assert metrics.registry.get_sample_value("ced_overlap_dropped_rows_total") == 2
    _assert_clean(engine, sched)


def test_a_slow_reader_gets_the_events_it_fell_behind_on_as_one():
    """Events queued while the reader was busy go out merged (in order, the last one's finish); an
    error is never merged into them; a reader that keeps up gets every event alone."""
    lp = lambda t: TokenLogprobs(t, -0.5, ((t, -0.5),))
    tok = lambda t, text: StreamEvent("r", token_ids=(t,), text=text, logprobs=(lp(t),))
    usage = Usage(3, 0, 3)

    async def read(events, keep_up):
        stream = RequestStream(None, "r", "", asyncio.get_running_loop())
        got = []
        for ev in events:
            stream._sink(ev)
            if keep_up:
                await asyncio.sleep(0)  # the sink's call_soon_threadsafe runs
                got.append(await anext(stream))
        await asyncio.sleep(0)
        async for ev in stream:
            got.append(ev)
        return got

    final = StreamEvent(
        "r", token_ids=(7,), text="c", logprobs=(lp(7),), finish_reason=FinishReason.STOP, usage=usage
    )
    events = [tok(5, "a"), tok(6, "b"), final]
    merged = asyncio.run(read(events, keep_up=False))
    assert len(merged) == 1 and merged[0].final and merged[0].usage == usage
    assert merged[0].token_ids == (5, 6, 7) and merged[0].text == "abc"
    assert [p.token_id for p in merged[0].logprobs] == [5, 6, 7]
    assert asyncio.run(read(events, keep_up=True)) == events
    failed = StreamEvent("r", error="engine failure")
    got = asyncio.run(read([tok(5, "a"), tok(6, "b"), failed], keep_up=False))
    assert [e.token_ids for e in got] == [(5, 6), ()] and got[1] == failed
