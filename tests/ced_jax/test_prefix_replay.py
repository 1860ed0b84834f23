"""A prefix-cache hit rebuilt by replay (spec 4.2 "encoder SWA bounded replay", made exact; issue 13.2):
a slot that reuses another sequence's pages before a page boundary b and prefills [b - H, b) again
with window_floor b - H and write_from b (H = `replay_tokens`) continues exactly as a cold run, bit
for bit, and leaves the shared pages untouched; a replay shorter than the SWA receptive field does not.
"""

from __future__ import annotations

import numpy as np
import pytest

import ced_jax
from ced_jax.engine import Engine, SamplingBatch, StateShapes, replay_tokens

PAGE = 16
WIDTH = 160  # every prefill call is padded to this (one program for all of them)
PROMPT = 150  # ends mid-page
CACHED = 128  # b: the cached prefix (8 pages)
DECODE = 4


@pytest.fixture(scope="module")
def tiny():
    return ced_jax.load("tiny")


def _engine(model, page=PAGE, with_draft=False):
    context = 2 * WIDTH
    shapes = StateShapes(max_slots=2, page_size=page, num_pages=3 * context // page, max_context=context)
    return Engine(model.loaded, shapes, with_draft=with_draft)


def _prefill(engine, slot, tokens, start, n, table, **kw):
    """One prefill call of `slot` (row 1 idle) over tokens [start, start + n); returns its sample."""
    other = 1 - slot
    padded = np.zeros((2, WIDTH), np.int32)
    padded[0, :n] = tokens[start : start + n]
    row = lambda v, dt, idle=0: np.array([v, idle], dt)
    tables = np.stack([table, np.zeros_like(table)])
    per_row = {k: row(v, np.int32) for k, v in kw.items()}
    out = engine.prefill_batch(
        np.array([slot, other], np.int32), padded, row(n, np.int32), row(start, np.int32), tables,
        SamplingBatch.broadcast(2), max_logprobs=5, **per_row,
    )  # fmt: skip
    return [np.asarray(a)[0] for a in out]


def _decode(engine, slot, token, table):
    """DECODE greedy tokens after the prompt: [(token, logprob, top ids, top logprobs)] per step."""
    steps = []
    for i in range(DECODE):
        out = engine.decode(
            np.array([slot], np.int32), np.array([token], np.int32), np.array([PROMPT + i], np.int32),
            np.array([True]), table[None], SamplingBatch.broadcast(1), max_logprobs=5,
        )  # fmt: skip
        steps.append([np.asarray(a)[0] for a in out])
        token = int(steps[-1][0])
    return steps


def _pages(engine):
    return [np.asarray(b).copy() for kind in (engine.state.kv, engine.state.index_k) for b in kind.values()]


def _run_cold(model, tokens, page=PAGE, with_draft=False, decode=True):
    engine = _engine(model, page, with_draft)
    table = np.arange(engine.shapes.pages_per_slot, dtype=np.int32)
    first = _prefill(engine, 0, tokens, 0, len(tokens), table)
    return first, _decode(engine, 0, int(first[0]), table) if decode else [], engine


def _run_hit(model, tokens, replay, page=PAGE, with_draft=False, decode=True):
    """Slot 0 prefills the first CACHED tokens into its pages; slot 1 takes those pages, replays
    [CACHED - replay, CACHED) and prefills the rest of the prompt in the same call, then decodes."""
    engine = _engine(model, page, with_draft)
    per_slot = engine.shapes.pages_per_slot
    owner = np.arange(per_slot, dtype=np.int32)
    _prefill(engine, 0, tokens, 0, CACHED, owner)
    shared = _pages(engine)
    table = np.concatenate([owner[: CACHED // page], per_slot + np.arange(per_slot - CACHED // page)])
    table = table.astype(np.int32)
    s = CACHED - replay
    engine.reset_history(1, engine.history_after(tokens[:s]))
    first = _prefill(engine, 1, tokens, s, len(tokens) - s, table, window_floor=s, write_from=CACHED)
    for before, now in zip(shared, _pages(engine), strict=True):  # the cached pages were not written
        np.testing.assert_array_equal(before[: CACHED // page], now[: CACHED // page])
    return first, _decode(engine, 1, int(first[0]), table) if decode else [], engine


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow  # compiles a prefill and a decode program and runs five prefills: about a minute
def test_a_replayed_prefix_hit_is_bit_identical_to_a_cold_run(tiny):
    cfg = tiny.cfg
    assert replay_tokens(cfg, PAGE) == 64  # 8 layers x (8 - 1) = 56 tokens, in whole pages
    tokens = np.random.default_rng(1302).integers(3, cfg.vocab_size, PROMPT).astype(np.int32)
    cold_first, cold_steps, cold = _run_cold(tiny, tokens)
    hit_first, hit_steps, hit = _run_hit(tiny, tokens, replay_tokens(cfg, PAGE))
    assert _same(hit_first, cold_first)
    for i, (a, b) in enumerate(zip(hit_steps, cold_steps, strict=True)):
        assert _same(a, b), f"decode step {i}"
    # The per-slot state too: every SWA ring and compressor partial group, bit for bit.
    for name in ("window", "state_kv", "state_score"):
        for key, ring in getattr(cold.state, name).items():
            np.testing.assert_array_equal(
                np.asarray(getattr(hit.state, name)[key])[1], np.asarray(ring)[0], err_msg=f"{name} {key}"
            )
    # One page of replay is far short of the receptive field: the result differs.
    short_first, short_steps, _ = _run_hit(tiny, tokens, PAGE)
    same = [_same(a, b) for a, b in zip(short_steps, cold_steps, strict=True)]
    assert not (_same(short_first, cold_first) and all(same))


def _rings(engine, slot, name):
    return {k: np.asarray(v)[slot] for k, v in getattr(engine.state, name).items()}


@pytest.mark.slow  # compiles the speculative engine's prefill program: about a minute
def test_a_replay_rebuilds_dsparks_context_rings(tiny):
    """DSpark's context rings hold the target layers' inputs at the W positions before the prompt's
    end: a prompt that ends 3 tokens past the hit still reads 5 replayed positions from them. The
    replay of `replay_tokens(..., with_draft=True)` rebuilds them and every SWA ring bit for bit; a
    one-page replay does not."""
    cfg = tiny.cfg
    # The deepest target is layer 7's input: 7 x (8 - 1) + 8 = 57 > 8 x (8 - 1) = 56; in pages, 64.
    assert max(cfg.dspark_target_layer_ids) == 7 and replay_tokens(cfg, PAGE, with_draft=True) == 64
    tokens = np.random.default_rng(1303).integers(3, cfg.vocab_size, CACHED + 3).astype(np.int32)
    cold_first, _, cold = _run_cold(tiny, tokens, with_draft=True, decode=False)
    for replay, exact in ((replay_tokens(cfg, PAGE, with_draft=True), True), (PAGE, False)):
        first, _, hit = _run_hit(tiny, tokens, replay, with_draft=True, decode=False)
        for name in ("window", "draft_window"):
            same = [np.array_equal(_rings(hit, 1, name)[k], r) for k, r in _rings(cold, 0, name).items()]
            assert all(same) == exact, (replay, name, same)
        assert _same(first, cold_first) == exact
