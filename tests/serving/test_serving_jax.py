"""The real engine (`serving.engine.jax_engine.JaxEngine`) on the embedded tiny model, over localhost gRPC.

One engine is compiled for the whole module (compiling is the expensive part on CPU); every test
leaves it idle. Exactness is checked against an independent path: `ced_jax.api.Session`, the dense
per-sequence cache the parity tests use, run with the same shapes as the engine (prefill one page
per call over the engine's `prefill_rows` rows, decode over all `max_slots` rows), where the two
must agree bit for bit. Shapes matter on XLA:CPU: a matmul over 1 row and over 32 rows may sum in
different orders, and the tiny random model turns a 1-ulp difference into O(1) logit differences
within a few tokens (PARITY.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_helpers import ServerThread, wait_until

import ced_jax
from ced_jax import cache as cache_lib
from ced_jax.api import describe
from ced_jax.config import preset
from ced_jax.engine import SamplingBatch
from serving import client
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.engine.protocol import DecodeBatch, PrefillChunk, SamplingParams
from serving.proto import ced_pb2_grpc
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(900)

# The shapes of the module's engine (and of the `ced-jax serve` subprocess, so that it finds the
# programs in the persistent compilation cache).
SLOTS, PAGE, CONTEXT, CHUNK = 32, 16, 128, 32
LONG_CHUNK, LONG_STEP = 64, 32  # the long-prompt program: two forwards of 32 tokens per call
SERVE_ARGS = ["--max-slots", str(SLOTS), "--page-size", str(PAGE), "--max-context", str(CONTEXT)]
SERVE_ARGS += ["--prefill-chunk", str(CHUNK)]
SERVE_ARGS += ["--long-prefill-chunk", str(LONG_CHUNK), "--long-prefill-step", str(LONG_STEP)]
PREFILL_ROWS = ServeConfig(max_slots=SLOTS).prefill_rows[-1]  # the default: one prefill program size
GREEDY = SamplingParams(temperature=0.0)
LOGPROB_ATOL = 4e-6  # a few float32 ulps at |log p| ~ 5; a misplaced KV entry moves them by > 1e-3
RNG = np.random.default_rng(20261201)


def _prompt(n: int) -> list[int]:
    return [0] + RNG.integers(3, 512, n - 1).tolist()  # BOS, then ids clear of eos/pad


@pytest.fixture(scope="module")
def model():
    return ced_jax.load("tiny")


@pytest.fixture(scope="module")
def engine(model):
    # The KV tiers' page copies and the long-prompt program compiled too (other engines of the module
    # leave the latter out: off by default at this context).
    eng = JaxEngine(
        model, _config(kv_host_bytes=1 << 20, long_prefill_chunk=LONG_CHUNK, long_prefill_step=LONG_STEP)
    )
    eng.warmup()
    return eng


def _config(**kw) -> ServeConfig:
    base = dict(
        max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,), max_tokens_limit=96,
        default_max_tokens=16, max_queued=64,
        metrics_port=0,
    )  # fmt: skip
    base.update(kw)
    return ServeConfig(**base)


@pytest.fixture(scope="module")
def server(engine, model):
    st = ServerThread(engine, ModelTokenizer(model), _config())
    yield st
    st.close()


# ------------------------------------------------------------------------------- the mirror
def mirror(
    model,
    prompt: list[int],
    generated: list[int],
    *,
    slots=SLOTS,
    page_size=PAGE,
    context=CONTEXT,
    prefill_rows=PREFILL_ROWS,
) -> list[np.ndarray]:
    """log_softmax of the logits after the prompt and after each generated token but the last,
    computed by `ced_jax.api.Session` calls (the `step` program, a page per call in row 0 of
    `prefill_rows` rows, the others idle, then decode steps over every slot) with the engine's
    shapes. [len(generated)] x [V]."""
    cfg = model.cfg
    one = model.new_session(prefill_rows, context)
    for s in range(0, len(prompt), page_size):
        page = prompt[s : s + page_size]
        padded = np.full((prefill_rows, page_size), cfg.pad_token_id, np.int32)
        padded[0, : len(page)] = page
        lens = np.zeros(prefill_rows, np.int32)
        lens[0] = len(page)
        logits, _ = one.step(padded, lens)
    out = [logits[0, len(page) - 1]]
    # Decode as the engine does: every slot is a row; the sequence sits in row 0 (other rows idle).
    batch = model.new_session(slots, context)
    src, dst = one.engine.state, batch.engine.state
    per_slot = lambda d, s: {k: d[k].at[0].set(s[k][0]) for k in d}  # row 0 is slot 0 in both
    pages = lambda d, s: {k: d[k].at[: s[k].shape[0]].set(s[k]) for k in d}  # row 0's pages come first
    batch.engine.state = dataclasses.replace(
        dst, window=per_slot(dst.window, src.window), state_kv=per_slot(dst.state_kv, src.state_kv),
        state_score=per_slot(dst.state_score, src.state_score), kv=pages(dst.kv, src.kv),
        index_k=pages(dst.index_k, src.index_k),
    )  # fmt: skip
    batch.positions = np.zeros(slots, np.int32)
    batch.positions[0] = len(prompt)
    batch.engine.history = np.repeat(one.engine.history[:1], slots, axis=0)
    lens = np.zeros(slots, np.int32)
    lens[0] = 1
    for tok in generated[:-1]:
        tokens = np.full((slots, 1), cfg.pad_token_id, np.int32)
        tokens[0, 0] = tok
        logits, _ = batch.step(tokens, lens)
        out.append(logits[0, 0])
    return [np.asarray(jax.nn.log_softmax(jnp.asarray(v))) for v in out]


def _check_against_mirror(model, prompt, token_ids, top_ids, top_logprobs):
    ref = mirror(model, prompt, token_ids)
    for step, (tok, ids, lps, r) in enumerate(zip(token_ids, top_ids, top_logprobs, ref, strict=True)):
        assert tok == int(np.argmax(r)), f"step {step}: greedy token differs"
        # The engine computes log_softmax inside its compiled step, fused differently from this
        # standalone one: the normaliser may differ in its last bits (measured: 1-2 ulp).
        np.testing.assert_allclose(
            np.asarray(lps, np.float32), r[np.asarray(ids)], rtol=0, atol=LOGPROB_ATOL, err_msg=f"step {step}"
        )


# ------------------------------------------------------------------------------- engine level
def test_buffers_are_the_packed_deployment_formats(engine):
    """890 bytes per token for v41-flash from the engine's own buffer layout (sized with
    eval_shape, nothing allocated), equal to what `describe` derives; tiny likewise."""
    v41 = preset("v41-flash")
    shapes = jax.eval_shape(lambda: cache_lib.init_paged_cache(v41, max_slots=1, page_size=128, num_pages=4))
    assert cache_lib.kv_bytes_per_token(shapes) == describe(v41)["kv_bytes_per_token"] == 890
    entry_bytes = {a.shape[-1] for a in (*shapes.kv.values(), *shapes.index_k.values())}
    assert entry_bytes == {288, 68}
    assert {a.shape[-1] for a in shapes.window.values()} == {528}
    assert {a.dtype for a in jax.tree.leaves(shapes) if a.ndim == 3 and a.dtype != jnp.float32} == {
        jnp.dtype(jnp.uint8)
    }
    assert engine.kv_bytes_per_token == describe(engine.cfg)["kv_bytes_per_token"]


def test_engine_prefill_and_decode_match_the_dense_model(engine, model):
    prompt = _prompt(41)  # two chunks (32 + 9), three pages
    table = np.zeros(CONTEXT // PAGE, np.int32)
    table[:4] = [9, 3, 20, 7]  # scattered pages
    slot = 0
    common = dict(slot=slot, page_table=table, history=np.zeros(0, np.int32), sampling=GREEDY)
    engine.prefill(PrefillChunk(token_ids=np.array(prompt[:32]), start_pos=0, is_last_chunk=False, **common))
    first = engine.prefill(
        PrefillChunk(token_ids=np.array(prompt[32:]), start_pos=32, is_last_chunk=True, **common)
    )
    toks = [first.token]
    tables = np.zeros((SLOTS, CONTEXT // PAGE), np.int32)
    tables[slot] = table
    try:
        for step in range(8):
            active = np.zeros(SLOTS, bool)
            active[slot] = True
            ids = np.zeros(SLOTS, np.int32)
            ids[slot] = toks[-1].token_id
            pos = np.zeros(SLOTS, np.int32)
            pos[slot] = len(prompt) + step
            res = engine.decode(DecodeBatch(
                active=active, token_ids=ids, positions=pos, page_tables=tables,
                sampling=SamplingBatch.broadcast(SLOTS),
            ))  # fmt: skip
            toks.append(res.row(slot))
    finally:
        engine.release(slot)
    _check_against_mirror(
        model, prompt, [t.token_id for t in toks], [t.top_ids for t in toks], [t.top_logprobs for t in toks]
    )
    assert engine.compiles_after_warmup == 0


def _table(slot: int) -> np.ndarray:
    """Slot s owns pages s * pages_per_slot ... (distinct for every slot)."""
    per = CONTEXT // PAGE
    return np.arange(slot * per, (slot + 1) * per, dtype=np.int32)


def _chunk(slot, tokens, start, *, last, table=None, **kw) -> PrefillChunk:
    return PrefillChunk(
        slot=slot, token_ids=np.asarray(tokens, np.int32), start_pos=start,
        page_table=_table(slot) if table is None else table, history=np.zeros(0, np.int32),
        sampling=GREEDY, is_last_chunk=last, **kw,
    )  # fmt: skip


def _hit_table(slot: int, owner: int, pages: int) -> np.ndarray:
    """The page table of a prefix hit in `slot`: its first `pages` pages are `owner`'s (cached)."""
    table = _table(slot)
    table[:pages] = _table(owner)[:pages]
    return table


def _decode_steps(engine, streams: dict[int, tuple[int, list]], steps: int, page_tables=None) -> None:
    """`steps` greedy decode steps over every slot in `streams` (slot -> (prompt length, sampled
    tokens so far)); each step's token is appended to its stream. page_tables: {slot: table} where
    it is not `_table(slot)`."""
    tables = np.stack([_table(s) for s in range(SLOTS)])
    for s, table in (page_tables or {}).items():
        tables[s] = table
    for _ in range(steps):
        active = np.zeros(SLOTS, bool)
        ids, pos = np.zeros(SLOTS, np.int32), np.zeros(SLOTS, np.int32)
        for s, (n, toks) in streams.items():
            active[s], ids[s], pos[s] = True, toks[-1].token_id, n + len(toks) - 1
        res = engine.decode(DecodeBatch(
            active=active, token_ids=ids, positions=pos, page_tables=tables,
            sampling=SamplingBatch.broadcast(SLOTS),
        ))  # fmt: skip
        for s, (_, toks) in streams.items():
            toks.append(res.row(s))


def _as_arrays(toks) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    return (
        [t.token_id for t in toks],
        np.array([t.logprob for t in toks]),
        np.stack([t.top_ids for t in toks]),
        np.stack([t.top_logprobs for t in toks]),
    )


def _prefill_chunks(engine, slot, prompt, start, *, table=None, write_from=0, beside=(), chunk=CHUNK):
    """Prefill prompt[start:] into `slot` in chunks of `chunk` tokens (a prefix hit when start > 0:
    window_floor start, write_from, the Engram history's tokens before start); beside: a list per
    call of other chunks sharing that call. Returns (the first sampled token, the other chunks'
    results)."""
    history = np.asarray(prompt[max(0, start - engine.spec.history_tokens) : start], np.int32)
    results, others = None, []
    for i, a in enumerate(range(start, len(prompt), chunk)):
        end = min(a + chunk, len(prompt))
        mine = _chunk(slot, prompt[a:end], a, last=end == len(prompt), table=table, window_floor=start,
                      write_from=write_from)  # fmt: skip
        if i == 0:
            mine = dataclasses.replace(mine, history=history)
        extra = list(beside[i]) if i < len(beside) else []
        results = engine.prefill_batch(extra + [mine])
        others.extend(results[:-1])
    return results[-1].token, others


def test_prefix_hit_is_exact_alone_and_beside_other_requests(engine):
    """One prompt served four ways: cold alone, cold with its chunks batched beside other requests'
    chunks, a prefix hit at 96 (replayed from 96 - replay_tokens = 32) beside others (and decoded
    among 12 streams, the 16-row decode program), a hit at 80 (replayed from 16) alone, and cold and
    as the hit at 96 through the long-prompt program (one row, 32 tokens per forward, 64-token
    chunks). The tokens and every log-prob are bit-identical: the replay rebuilds the rings from the
    cached tokens, the page program has one row count (`prefill_rows`), and `forward` computes a token
    the same way whatever the rows and the tokens of its step."""
    assert engine.spec.replay_tokens == 64  # 8 layers x (8 - 1) tokens of SWA receptive field
    prompt = _prompt(110)  # 6 full pages, then [96, 110)
    others = [_prompt(n) for n in (20, 32, 9, 30, 17, 28, 25, 12, 31, 22, 14)]
    steps = 6
    runs = {}
    try:
        # 1. cold, alone
        token, _ = _prefill_chunks(engine, 0, prompt, 0)
        stream = {0: (len(prompt), [token])}
        _decode_steps(engine, stream, steps)
        runs["cold alone"] = stream[0][1]
        engine.release(0)

        # 2. cold, its chunks beside other requests' chunks (one a single partial page)
        beside = [[_chunk(1, others[0], 0, last=True), _chunk(2, others[1], 0, last=True),
                   _chunk(3, others[2], 0, last=True)], [], [_chunk(4, others[3], 0, last=True)]]  # fmt: skip
        token, res = _prefill_chunks(engine, 0, prompt, 0, beside=beside)
        crowd = {
            s: (len(others[i]), [r.token]) for i, (s, r) in enumerate(zip((1, 2, 3, 4), res, strict=True))
        }
        stream = {0: (len(prompt), [token]), **crowd}
        _decode_steps(engine, stream, steps)
        runs["cold beside others"] = stream[0][1]
        for s in stream:
            engine.release(s)

        # 3. a hit at 96 beside others, then decoded among 12 streams (the 16-row decode program)
        by_slot = dict(zip((1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12), others, strict=True))
        crowd = {}
        for group in ((1, 2, 3, 4), (6, 7, 8, 9), (10, 11)):
            chunks = [_chunk(s, by_slot[s], 0, last=True) for s in group]
            for s, r in zip(group, engine.prefill_batch(chunks), strict=True):
                crowd[s] = (len(by_slot[s]), [r.token])
        table = _hit_table(5, 0, 6)
        beside = [[_chunk(12, by_slot[12], 0, last=True)]]
        token, res = _prefill_chunks(engine, 5, prompt, 32, table=table, write_from=96, beside=beside)
        crowd[12] = (len(by_slot[12]), [res[0].token])
        stream = {5: (len(prompt), [token]), **crowd}
        assert len(stream) == 12
        _decode_steps(engine, stream, steps, {5: table})
        runs["hit at 96 beside others"] = stream[5][1]
        for s in stream:
            engine.release(s)

        # 4. a hit at 80, alone
        table = _hit_table(7, 0, 5)
        token, _ = _prefill_chunks(engine, 7, prompt, 16, table=table, write_from=80)
        stream = {7: (len(prompt), [token])}
        _decode_steps(engine, stream, steps, {7: table})
        runs["hit at 80 alone"] = stream[7][1]
        engine.release(7)

        # 5. cold, then a hit at 96 (replayed from 32: 78 tokens), through the long-prompt program
        calls = engine.long_prefill_calls
        token, _ = _prefill_chunks(engine, 8, prompt, 0, chunk=LONG_CHUNK)
        stream = {8: (len(prompt), [token])}
        _decode_steps(engine, stream, steps)
        runs["cold, long program"] = stream[8][1]
        table = _hit_table(9, 8, 6)
        token, _ = _prefill_chunks(engine, 9, prompt, 32, table=table, write_from=96, chunk=LONG_CHUNK)
        engine.release(8)
        stream = {9: (len(prompt), [token])}
        _decode_steps(engine, stream, steps, {9: table})
        runs["hit at 96, long program"] = stream[9][1]
        engine.release(9)
        assert engine.long_prefill_calls - calls == 3  # 64 + 46 tokens; 64 of the hit's 78 (then 14)
    finally:
        for s in range(SLOTS):
            engine.release(s)
    want = _as_arrays(runs["cold alone"])
    for name, toks in runs.items():
        got = _as_arrays(toks)
        assert got[0] == want[0], name
        for a, b in zip(got[1:], want[1:], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert engine.compiles_after_warmup == 0


def test_narrow_page_tables_give_the_full_width_tokens_bit_for_bit(engine, model):
    """`decode_context_buckets`: an engine whose steps read their page tables only up to 64 tokens
    while every row is shorter (then the full 128) gives the module engine's tokens and log-probs
    bit for bit: a prompt decoded across the 64-token boundary, then a second request prefilled at
    both widths beside it. The narrow engine ran both widths (fails if it never cut a table, or
    if it cut one too short: a row then misses its entries)."""
    narrow = JaxEngine(model, _config(decode_context_buckets=(64, CONTEXT), decode_buckets=(8, SLOTS)))
    narrow.warmup()
    assert narrow.context_pages == (4, CONTEXT // PAGE)
    first, second = _prompt(40), _prompt(90)
    runs = []
    for eng in (engine, narrow):
        streams = {}
        try:
            token, _ = _prefill_chunks(eng, 30, first, 0)
            streams[30] = (len(first), [token])
            _decode_steps(eng, streams, 30)  # positions 40 .. 69: widths 4 pages, then 8
            token, _ = _prefill_chunks(eng, 31, second, 0)  # chunks ending at 31, 63 (4 pages), 89 (8)
            streams[31] = (len(second), [token])
            _decode_steps(eng, streams, 6)
        finally:
            eng.release(30)
            eng.release(31)
        runs.append({s: _as_arrays(toks) for s, (_, toks) in streams.items()})
    for s in (30, 31):
        assert runs[1][s][0] == runs[0][s][0], f"slot {s}"
        for a, b in zip(runs[1][s][1:], runs[0][s][1:], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"slot {s}")
    assert narrow.decode_widths_used[4] == 24 and narrow.decode_widths_used[8] == 12
    assert narrow.prefill_widths_used[4] == 4 and narrow.prefill_widths_used[8] == 1
    assert set(engine.decode_widths_used) == {CONTEXT // PAGE}
    assert narrow.compiles_after_warmup == 0 and engine.compiles_after_warmup == 0


def test_decode_context_buckets_must_hold_the_indexer_top_k(model):
    """A width whose entries are fewer than the indexer's top-k would change the selection's shape."""
    with pytest.raises(ValueError, match="buckets: 16 tokens hold 8 entries of compress ratio 2"):
        JaxEngine(model, _config(decode_context_buckets=(16, CONTEXT)))
    with pytest.raises(
        ValueError, match=r"decode_context_buckets \(--decode-context-buckets\) must be ascending multiples"
    ):
        _config(decode_context_buckets=(24, CONTEXT))


def test_decode_segments_take_turns_with_the_uninterrupted_tokens(engine, model):
    """Output-side flow control on the real engine: one request at a time (max_running 1), segments
    of 6 tokens. The two requests take turns (the second's first token comes before the first
    finishes), and each stream is token for token the one it gets without yielding: the yielded
    request's context comes back through the prefix cache and a re-prefill of its own output, which
    the chunk-invariant forward computes as its decode steps did, and the sampler draws by (seed,
    position)."""
    from serving.metrics import Metrics
    from serving.requests import GenerationRequest
    from serving.scheduling.scheduler import Scheduler
    from serving.scheduling.streams import collect

    prompts = {"a": _prompt(37), "b": _prompt(21)}
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=77)

    def run(segment):
        metrics = Metrics()
        sched = Scheduler(
            engine, ModelTokenizer(model), _config(max_running=1, decode_segment_tokens=segment), metrics
        )
        order, events = [], {rid: [] for rid in prompts}
        for rid, prompt in prompts.items():
            req = GenerationRequest(
                request_id=rid,
                prompt_token_ids=tuple(prompt),
                max_tokens=20,
                sampling=sampling,
                ignore_eos=True,
            )
            sched.submit(req, lambda ev, rid=rid: (events[rid].append(ev), order.append((rid, ev.final))))
        while sched.step():
            pass
        assert sched.num_in_flight == 0 and sched.pool.num_referenced == 0
        sched.pool.check_invariants()
        b_first = next(i for i, (rid, _) in enumerate(order) if rid == "b")
        a_end = order.index(("a", True))
        yields = metrics.registry.get_sample_value("ced_decode_segment_yields_total")
        return {rid: collect(ev)[0] for rid, ev in events.items()}, b_first < a_end, yields

    plain, b_before_a_ends, yields = run(0)
    assert not b_before_a_ends and yields == 0
    turns, b_before_a_ends, yields = run(6)
    assert b_before_a_ends and yields >= 3
    assert all(len(ids) == 20 for ids in plain.values())
    assert turns == plain
    assert engine.compiles_after_warmup == 0


def test_pages_copy_out_and_back_in_bit_for_bit(engine):
    """KV tiers' engine side: a prefilled slot's pages read out as one blob per page (890 B/token
    for v41-flash, 210 for tiny), written into other pages and read back, byte for byte; the source
    pages are untouched; bad page ids are field-named errors."""
    from serving.engine.jax_engine import weights_id

    spec = engine.spec
    assert spec.kv_page_bytes == 210 * PAGE and len(engine.kv_fingerprint()) == 16
    engine.prefill(_chunk(1, _prompt(CHUNK), 0, last=True))
    src, dst = _table(1)[:2].tolist(), _table(2)[:2].tolist()
    blobs = engine.read_pages(src)
    assert [len(b) for b in blobs] == [spec.kv_page_bytes] * 2 and any(any(b) for b in blobs)
    engine.write_pages(dst, blobs)
    assert engine.read_pages(dst) == blobs and engine.read_pages(src) == blobs
    assert engine.read_pages(src[:1] * 3) == [blobs[0]] * 3  # more pages than a bucket holds once
    with pytest.raises(ValueError, match="pages outside"):
        engine.read_pages([spec.num_pages])
    with pytest.raises(ValueError, match="distinct"):
        engine.write_pages([dst[0], dst[0]], blobs)
    engine.release(1)
    assert engine.compiles_after_warmup == 0  # warm-up compiled every page-copy bucket
    assert len(weights_id(engine.model)) == 16 and engine.kv_fingerprint() == engine.kv_fingerprint()


def test_prefix_from_host_and_disk_tiers_gives_the_cold_tokens(engine, model, tmp_path):
    """KV tiers on the real engine: a prompt's cached blocks offloaded to host memory, and (another
    scheduler, another process's directory) to disk, come back into fresh pages on the next request
    sharing them, which replays its last cached tokens and gives the cold run's tokens and
    log-probabilities bit for bit; nothing compiles after warm-up."""
    from serving.requests import GenerationRequest
    from serving.scheduling.scheduler import Scheduler
    from serving.scheduling.streams import collect

    shared = _prompt(112)  # 7 pages: a hit replays the last 64 of them (tiny: 8 layers x (8 - 1) tokens)
    tail = RNG.integers(3, 512, 9).tolist()
    sampling = SamplingParams(temperature=0.0)

    def run(sched, rid, prompt):
        events = []
        sched.submit(
            GenerationRequest(
                request_id=rid,
                prompt_token_ids=tuple(prompt),
                max_tokens=6,
                sampling=sampling,
                logprobs=3,
                ignore_eos=True,
            ),
            events.append,
        )
        while sched.step():
            pass
        ids, _, last = collect(events)
        lps = [(p.logprob, p.top) for ev in events for p in ev.logprobs]
        return ids, lps, last.usage.cached_prompt_tokens

    cold = run(Scheduler(engine, ModelTokenizer(model), _config(metrics_port=None)), "cold", shared + tail)
    assert cold[2] == 0
    host = Scheduler(engine, ModelTokenizer(model), _config(kv_host_bytes=1 << 24))
    run(host, "fill", shared + [5, 6, 7])
    assert host.offload_prefix_cache() == 7 and host.pool.cached_entries() == []
    assert engine.spec.replay_tokens == 64
    from_host = run(host, "host", shared + tail)
    assert from_host[2] == 112 and from_host[:2] == cold[:2]
    host.close_tiers()
    disk_cfg = _config(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=1 << 24)
    writer = Scheduler(engine, ModelTokenizer(model), disk_cfg)
    run(writer, "fill", shared + [5, 6, 7])
    writer.close_tiers()  # shutdown: the device cache goes to disk
    reader = Scheduler(engine, ModelTokenizer(model), disk_cfg)  # a restart on the same directory
    from_disk = run(reader, "disk", shared + tail)
    assert from_disk[2] == 112 and from_disk[:2] == cold[:2]
    reader.close_tiers()
    assert engine.compiles_after_warmup == 0


def test_another_checkpoint_of_the_config_never_reads_the_disk_tiers_kv(engine, model, tmp_path):
    """Issue 33.1's reproduction at the engine: 12 prompts sharing a 32-token prefix served with a
    small host tier spilling to disk, shut down; then the same config with `kv_norm` of layers 0 and
    1 scaled by 1.5 (weights that differ in no embedding or head row) on the same directory. The old
    blocks are refused and deleted, no request reuses a cached token from them, and every greedy
    output is the modified model's cold one."""
    from ced_jax.api import Model
    from ced_jax.testing.random_weights import embedded_params
    from serving.requests import GenerationRequest
    from serving.scheduling.scheduler import Scheduler
    from serving.scheduling.streams import collect

    flat = embedded_params("tiny", with_draft=False)
    for layer in (0, 1):
        name = f"layers.{layer}.attn.kv_norm.weight"
        flat[name] = (flat[name].astype(np.float32) * 1.5).astype(flat[name].dtype)
    changed = Model(
        model.cfg, flat, hasher=model.hasher, tokenizer_path=model.tokenizer_path,
        engram_placement=model.engram_placement, weight_layout=model.weight_layout,
    )  # fmt: skip
    assert changed.programs is model.programs  # the same config: nothing to compile
    # Its own random stream: drawing from the module's RNG would change every later test's prompt.
    rng = np.random.default_rng(3301)
    prefix = [0, *rng.integers(3, 512, 31).tolist()]
    prompts = [prefix + rng.integers(3, 512, 5).tolist() for _ in range(12)]

    def run(sched, prompts):
        """The first prompt alone (its prefix pages are cached when it ends), then the rest at once."""
        events = {i: [] for i in range(len(prompts))}
        for batch in ([0], range(1, len(prompts))):
            for i in batch:
                req = GenerationRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=tuple(prompts[i]),
                    max_tokens=6,
                    sampling=GREEDY,
                    ignore_eos=True,
                )
                sched.submit(req, events[i].append)
            while sched.step():
                pass
        results = [collect(events[i]) for i in range(len(prompts))]
        return [ids for ids, _, _ in results], [last.usage.cached_prompt_tokens for _, _, last in results]

    changed_engine = JaxEngine(changed, _config(kv_host_bytes=1 << 20))
    changed_engine.warmup()  # the module engine's programs: run, not compiled
    cold, _ = run(
        Scheduler(changed_engine, ModelTokenizer(changed), _config(enable_prefix_cache=False)), prompts
    )
    tiers = dict(
        kv_host_bytes=2 * engine.spec.kv_page_bytes, kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=1 << 24
    )
    writer = Scheduler(engine, ModelTokenizer(model), _config(**tiers))
    old_tokens, old_cached = run(writer, prompts)
    assert sum(old_cached) >= 11 * 32  # the old model did reuse its prefix
    assert old_tokens != cold  # the change shows in the tokens (else this test could not fail)
    writer.close_tiers()
    assert len(list((tmp_path / "kv").glob("*.kvb"))) > 0
    reader = Scheduler(changed_engine, ModelTokenizer(changed), _config(**tiers))
    assert reader.tiers.disk.refused_removed > 0 and reader.tiers.disk.pages == 0
    tokens, cached = run(reader, prompts)
    assert cached[0] == 0 and tokens == cold
    reader.close_tiers()


def test_engine_rejects_calls_it_was_not_compiled_for(engine):
    table = np.zeros(CONTEXT // PAGE, np.int32)
    chunk = dict(slot=1, page_table=table, history=np.zeros(0, np.int32), sampling=GREEDY, is_last_chunk=True)
    with pytest.raises(ValueError, match=f"chunk length {LONG_CHUNK + 1} outside 1..{LONG_CHUNK}"):
        engine.prefill(PrefillChunk(token_ids=np.ones(LONG_CHUNK + 1, np.int32), start_pos=0, **chunk))
    # Above the prefill chunk: the long-prompt program, alone and text only.
    beside = PrefillChunk(token_ids=np.ones(4, np.int32), start_pos=0, **{**chunk, "slot": 2})
    with pytest.raises(ValueError, match="goes alone and without image spans"):
        engine.prefill_batch(
            [beside, PrefillChunk(token_ids=np.ones(CHUNK + 1, np.int32), start_pos=0, **chunk)]
        )
    with pytest.raises(ValueError, match="not page aligned"):
        engine.prefill(PrefillChunk(token_ids=np.ones(4, np.int32), start_pos=8, **chunk))
    with pytest.raises(ValueError, match="starts at its window_floor"):
        engine.prefill(PrefillChunk(token_ids=np.ones(4, np.int32), start_pos=16, **chunk))
    with pytest.raises(ValueError, match=f"history of 0 tokens, expected {engine.spec.history_tokens}"):
        engine.prefill(PrefillChunk(token_ids=np.ones(4, np.int32), start_pos=16, window_floor=16, **chunk))


def test_compile_counter_sees_a_call_that_needs_a_new_program(model, engine):
    """The counter counts JAX's own compilation events, so it moves when a serving call compiles.

    A separate engine, since this one is left with a compile on its record; it has the module engine's
    shapes, so its warm-up reuses the process's compiled programs (`Programs.shared`: nothing is built,
    which the counter must not mistake for a compile after warm-up). A decode batch with a batch size
    warm-up did not compile is a new input shape: jit compiles again."""
    small = JaxEngine(model, _config(kv_host_bytes=1 << 20))
    small.warmup()
    assert small.compiles_after_warmup == 0
    S, P = small.spec.max_slots, small.spec.pages_per_slot

    def idle_batch(pages: int) -> DecodeBatch:
        return DecodeBatch(
            active=np.zeros(S, bool), token_ids=np.zeros(S, np.int32), positions=np.zeros(S, np.int32),
            page_tables=np.zeros((S, pages), np.int32), sampling=SamplingBatch.broadcast(S),
        )  # fmt: skip

    small.decode(idle_batch(P))  # the warmed-up shapes: no compile
    assert small.compiles_after_warmup == 0
    assert 1 not in small.decode_buckets
    small._decode_idle_rows(1, P)  # a batch size warm-up did not compile
    assert small.compiles_after_warmup == 1
    small._decode_idle_rows(1, P)  # now cached
    assert small.compiles_after_warmup == 1


# ------------------------------------------------------------------------------- over gRPC
def _logprob_arrays(out):
    ids = [[t.token_id for t in lp.top] for lp in out.logprobs]
    lps = [[t.logprob for t in lp.top] for lp in out.logprobs]
    return ids, lps


def test_grpc_greedy_stream_is_the_model(server, model):
    prompt = _prompt(37)
    out = client.generate(server.addr, prompt, max_tokens=10, temperature=0.0, logprobs=5, ignore_eos=True,
                          timeout=120)  # fmt: skip
    assert out.finish_reason == "length" and len(out.token_ids) == 10 and out.messages >= 2
    assert out.usage.prompt_tokens == 37 and out.usage.completion_tokens == 10
    _check_against_mirror(model, prompt, out.token_ids, *_logprob_arrays(out))
    assert out.text == model.decode_text(out.token_ids)
    server.assert_idle()


def test_a_long_prompt_alone_goes_through_the_long_program(server, model):
    """Nothing decoding: a prompt of more than a chunk goes in alone through the long-prompt program
    (64-token calls: 64 + 56 here); its tokens and log-probabilities are the mirror's (a page per
    call). Bit for bit against the page program: test_prefix_hit_is_exact_alone_and_beside_other_requests."""
    engine = server.server.engine
    prompt = _prompt(120)
    before = engine.long_prefill_calls
    out = client.generate(server.addr, prompt, max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True,
                          timeout=120)  # fmt: skip
    assert engine.long_prefill_calls - before == 2
    _check_against_mirror(model, prompt, out.token_ids, *_logprob_arrays(out))
    assert engine.compiles_after_warmup == 0
    server.assert_idle()


def test_prefix_cache_hit_gives_the_cold_logits(server, model):
    shared = _prompt(100)  # six full pages are shareable (the block holding the last token never is)
    a = shared + [11, 12, 13]
    b = shared + [21, 22, 23, 24, 25]
    kw = dict(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True, timeout=120)
    cold_b = client.generate(server.addr, b, **kw)
    hit_a = client.generate(server.addr, a, **kw)
    hit_b = client.generate(server.addr, b, **kw)
    assert cold_b.usage.cached_prompt_tokens == 0
    assert hit_a.usage.cached_prompt_tokens == 96  # pages 0-5 of b's prompt, across requests
    assert hit_b.usage.cached_prompt_tokens == 96  # (replayed from 96 - 64)
    # Exactly the cold run's tokens and log-probabilities (the hit replayed the cached tokens to
    # rebuild the SWA rings, with the Engram history of the tokens before the replay).
    assert hit_b.token_ids == cold_b.token_ids
    assert _logprob_arrays(hit_b) == _logprob_arrays(cold_b)
    _check_against_mirror(model, a, hit_a.token_ids, *_logprob_arrays(hit_a))
    server.assert_idle()


def test_ced_prefill_request_is_the_library_ced_prefill(server, model):
    """A request with prefill_mode CED (the encoder layers over the whole prompt, the decoder layers
    over its last sliding window) gives the tokens of `Model.generate(..., prefill_mode="ced")` (the
    library runs the two passes in whole chunks, the server page by page in its prefill loop: equal
    because `forward` is chunk-invariant), and EXACT those of the exact prefill; a value outside the
    enum is INVALID_ARGUMENT naming the field. Prefix hits across modes are exact too: the pages are
    the encoder's (the same in both modes) and the replay rebuilds the rings under the hitting
    request's own mode and decoder window."""
    prompt = _prompt(100)  # sliding window 8: 92 prompt tokens run only the encoder layers
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)
    ced = client.generate(server.addr, prompt, prefill_mode="ced", **kw)
    exact = client.generate(server.addr, prompt, prefill_mode="exact", **kw)
    assert ced.token_ids == model.generate(prompt, 8, stop_at_eos=False, prefill_mode="ced")["token_ids"]
    assert exact.token_ids == model.generate(prompt, 8, stop_at_eos=False)["token_ids"]
    assert exact.usage.cached_prompt_tokens == 96  # the CED run's pages
    longer = prompt + _prompt(13)[1:]  # a CED prompt whose decoder window starts past the hit
    ced_hit = client.generate(server.addr, longer, prefill_mode="ced", **kw)
    assert ced_hit.usage.cached_prompt_tokens == 96
    assert ced_hit.token_ids == model.generate(longer, 8, stop_at_eos=False, prefill_mode="ced")["token_ids"]
    stub = ced_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(server.addr))
    req = client.build_request(prompt, max_tokens=2)
    req.prefill_mode = 7
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill_mode" in err.value.details()
    server.assert_idle()


def test_sampling_alone_equals_sampling_among_31_others(server):
    prompt = _prompt(30)
    params = dict(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    alone = client.generate(server.addr, prompt, timeout=120, **params)
    lengths, seeds = RNG.integers(5, 60, 31), RNG.integers(0, 2**31, 31)
    others = [(_prompt(int(n)), int(s)) for n, s in zip(lengths, seeds, strict=True)]

    async def crowd():
        async def one(p, **kw):
            msgs = [m async for m in client.astream(server.addr, p, timeout=300, **kw)]
            return client.collect(msgs)

        jobs = [one(p, max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for p, s in others[:16]]
        jobs.append(one(prompt, **params))
        jobs += [one(p, max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for p, s in others[16:]]
        return await asyncio.gather(*jobs)

    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], server.scheduler.num_running)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(crowd())
    finally:
        done.set()
        watcher.join()
    assert peak[0] >= 16  # it really was batched with others
    assert results[16].token_ids == alone.token_ids
    assert all(len(r.token_ids) == 12 for r in results)
    assert server.server.engine.compiles_after_warmup == 0
    server.assert_idle()


def test_without_batch_invariance_a_lone_stream_decodes_at_one_row(model, monkeypatch):
    """--no-batch-invariant: the batch in use, not 8 padded rows; a lone request's tokens and
    log-probabilities are then the model's at one row (the mirror at 1 slot, 1 prefill row)."""
    config = _config(max_slots=2, batch_invariant=False)
    assert (config.decode_buckets, config.prefill_rows) == ((1, 2), (1, 2))
    engine = JaxEngine(model, config)
    engine.warmup()
    rows = []
    place = engine._place_rows
    monkeypatch.setattr(engine, "_place_rows", lambda active: rows.append(len(p := place(active))) or p)
    st = ServerThread(engine, ModelTokenizer(model), config)
    try:
        prompt = _prompt(37)
        out = client.generate(st.addr, prompt, max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True,
                              timeout=120)  # fmt: skip
        ref = mirror(model, prompt, out.token_ids, slots=1, prefill_rows=1)
        top_ids, top_logprobs = _logprob_arrays(out)
        for step, (tok, ids, lps, r) in enumerate(
            zip(out.token_ids, top_ids, top_logprobs, ref, strict=True)
        ):
            assert tok == int(np.argmax(r)), f"step {step}: greedy token differs"
            np.testing.assert_allclose(
                np.asarray(lps, np.float32), r[np.asarray(ids)], rtol=0, atol=LOGPROB_ATOL
            )
        assert rows and set(rows) == {1}
        assert engine.compiles_after_warmup == 0
        st.assert_idle()
    finally:
        st.close()


def test_cancel_mid_stream_frees_slot_and_pages(server):
    prompt = _prompt(20)
    channel = grpc.insecure_channel(server.addr)
    stub = ced_pb2_grpc.InferenceServiceStub(channel)
    call = stub.Generate(client.build_request(prompt, max_tokens=90, ignore_eos=True, temperature=0.0))
    seen = 0
    for msg in call:
        seen += len(msg.token_ids)
        if seen >= 3:
            break
    wait_until(lambda: server.scheduler.num_running == 1, timeout=30)
    call.cancel()
    channel.close()
    server.assert_idle(timeout=30)


def test_limits_are_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(server.addr, _prompt(CONTEXT + 1), max_tokens=1, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(CONTEXT) in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.generate(server.addr, _prompt(8), max_tokens=97, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.generate(server.addr, [0, 512], max_tokens=2, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in e.value.details()


def test_stop_string_across_tokens_never_leaks(server, model):
    prompt = _prompt(12)
    free = client.generate(server.addr, prompt, max_tokens=16, temperature=0.0, ignore_eos=True, timeout=120)
    text = free.text
    # A stop string that starts inside one token's text and ends inside a later one, and whose
    # first occurrence in the text is there (real text repeats short strings).
    pieces = [model.decode_text(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]
    candidates = []
    for i in range(2, len(pieces)):
        complete = text.startswith(pieces[i - 1])  # no partial UTF-8 sequence at the boundary
        if complete and len(pieces[i]) > len(pieces[i - 1]) + 1 and len(pieces[i - 1]) >= 1:
            start = len(pieces[i - 1]) - 1
            stop = text[start : start + 2]
            if len(stop) == 2 and text.find(stop) == start:
                candidates.append((start, stop))
    assert candidates, f"no token boundary with a unique 2-character string across it in {text!r}"
    start, stop = candidates[0]
    out = client.generate(server.addr, prompt, max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop],
                          timeout=120)  # fmt: skip
    assert out.finish_reason == "stop"
    assert out.text == text[:start] and stop not in out.text
    server.assert_idle()


def test_metrics_endpoint(server):
    port = server.server.metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in ("ced_time_to_first_token_seconds_count", "ced_time_per_output_token_seconds_count",
                 "ced_kv_pages_free", "ced_kv_pages_used", "ced_active_slots", "ced_queue_depth",
                 "ced_prefix_cache_hit_rate"):  # fmt: skip
        assert name in body, name
    compiles = re.search(r"^ced_compiles_after_warmup (\S+)$", body, re.M)
    assert compiles and float(compiles.group(1)) == 0.0
    ttft = re.search(r"^ced_time_to_first_token_seconds_count (\S+)$", body, re.M)
    assert float(ttft.group(1)) >= 3


# ------------------------------------------------------------------------------- ced-jax serve
def test_ced_jax_serve_and_client_then_sigterm(engine, tmp_path):
    """`ced-jax serve tiny` in a subprocess (programs from the persistent compilation cache the module
    engine filled), `ced-jax client` against it, then SIGTERM: exit status 0."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "8",
        "JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "PYTHONPATH": str(REPO),
    }
    cmd = [sys.executable, "-m", "ced_cli.main", "serve", "tiny", *SERVE_ARGS]
    cmd += ["--port", "0", "--metrics-port", "-1", "--http-port", "0"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        addr = None
        end = time.monotonic() + 600
        while addr is None and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.5)
            m = re.search(r"serving \S+ on (\S+)", (tmp_path / "serve.log").read_text())
            addr = m and m.group(1)
        assert addr, (tmp_path / "serve.log").read_text()[-3000:]
        r = subprocess.run([sys.executable, "-m", "ced_cli.main", "client", addr, "--prompt", "hello world",
                            "--max-tokens", "5", "--temperature", "0"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "completion_tokens=" in r.stderr and "finish_reason=" in r.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_conversation_evicted_from_the_device_comes_back_from_host_over_grpc(engine, model):
    """Sessions (issue 13.4) over gRPC on a server with a host KV tier: turn 1, then enough other
    traffic to evict turn 1's blocks from the device cache (LRU), then turn 2 (turn 1's prompt, its
    reply, a new message): its cached_prompt_tokens covers turn 1's prompt and reply, restored from
    host memory (not recomputed), and its tokens are the library's for that prompt. Runs last in the
    module: this server rewrites pages the module's `server` may have cached."""
    st = ServerThread(engine, ModelTokenizer(model), _config(kv_host_bytes=1 << 26))
    try:
        kw = dict(temperature=0.0, ignore_eos=True, timeout=120)
        turn1 = _prompt(60)
        reply = client.generate(st.addr, turn1, max_tokens=8, **kw).token_ids
        num_pages = st.scheduler.pool.num_pages

        async def traffic():
            async def one(p):
                return client.collect([m async for m in client.astream(st.addr, p, max_tokens=1, **kw)])

            return await asyncio.gather(*[one(_prompt(112)) for _ in range(num_pages // 7 + 8)])

        asyncio.run(traffic())
        st.assert_idle()
        assert st.scheduler.pool.evictions > 0
        turn2 = turn1 + list(reply) + RNG.integers(3, 512, 20).tolist()
        out = client.generate(st.addr, turn2, max_tokens=6, **kw)
        assert out.usage.cached_prompt_tokens == 64  # prompt 60 + reply 8, KV written for 67: 4 pages
        registry = st.server.metrics.registry
        assert registry.get_sample_value("ced_kv_tier_hits_total", {"tier": "host"}) >= 4
        assert out.token_ids == model.generate(turn2, 6, stop_at_eos=False)["token_ids"]
        st.assert_idle()
    finally:
        st.close()
