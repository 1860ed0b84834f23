"""Speculative decoding in the engine (issue 15 point 2): rollback, verification, rejection sampling.

- Rollback: a verify chunk of T tokens followed by `PagedCache.keep_accepted(kept)` leaves every
  per-slot buffer (SWA rings, compressor partial groups, DSpark rings) bit-identical to the same
  program run with lens = kept, and the visible page entries too, for every kept in 0..T.
- Verification with known drafts: drafts equal to the target's own greedy continuation are all
  accepted; a wrong draft at index j stops acceptance at j, and the token emitted there is the
  target's greedy token. The emitted sequence equals plain greedy decoding.
- Rejection sampling (`ced_jax.sampling.speculative_sample`) on the tiny model's real target and
  draft distributions: the first emitted token follows the target's filtered distribution p, not the
  draft's q (chi-square over many seeds; the control with q's samples accepted blindly fails it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ced_jax
from ced_jax import cache as cache_lib
from ced_jax.api.session import session_page_size
from ced_jax.engine import Engine, SamplingBatch, StateShapes
from ced_jax.sampling import draft_token, filter_logits, speculative_sample


@pytest.fixture(scope="module")
def model():
    m = ced_jax.load("tiny")
    assert "mtp" in m.params, "the tiny preset carries DSpark stages"
    return m


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, 500, size=n)]


def _engine(model, slots: int, context: int = 128) -> tuple[Engine, np.ndarray]:
    page = session_page_size(model.cfg)
    shapes = StateShapes(
        max_slots=slots, page_size=page, num_pages=slots * context // page, max_context=context
    )
    engine = Engine(model.loaded, shapes, with_draft=True)
    return engine, cache_lib.contiguous_page_tables(slots, shapes.pages_per_slot)


def _prefill(engine, tables, prompts):
    rows = len(prompts)
    width = max(len(p) for p in prompts)
    tokens = np.zeros((rows, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    logits, _ = engine.step(tokens, np.zeros(rows, np.int32), lens, np.arange(rows, dtype=np.int32), tables)
    return np.asarray(logits)[np.arange(rows), lens - 1]


def _slot_buffers(state):
    return {
        "window": state.window,
        "state_kv": state.state_kv,
        "state_score": state.state_score,
        "draft_window": state.draft_window,
    }


@pytest.mark.slow  # two full forwards in one program to compile (minutes on 2 cores)
def test_keep_accepted_equals_a_shorter_chunk(model):
    """forward over T tokens + keep_accepted(k) == forward over the first k tokens, per-slot state bit for
    bit, for k = 0..T, with the chunk crossing a ratio-2 group boundary and the SWA ring's wrap."""
    from ced_jax.model import forward

    cfg = model.cfg
    engine, tables = _engine(model, 2)
    prompt = [_prompt(1, 13), _prompt(2, 14)]  # odd and even: partial groups of both phases
    _prefill(engine, tables, prompt)
    start = np.array([13, 14], np.int32)
    chunk = np.array([_prompt(3, 5), _prompt(4, 5)], np.int32)
    t = chunk.shape[1]
    rows = engine.history[np.arange(2)]
    engram = engine.engram_inputs(engine.hasher.hash_ids(rows, chunk, None))  # ids, or gathered rows
    slots = np.arange(2, dtype=np.int32)

    def visible_entries(state, kept):
        meta = cache_lib.StepMetadata(
            start=jnp.asarray(start), lens=kept, slots=jnp.asarray(slots), page_tables=jnp.asarray(tables)
        )
        return {
            f"{kind}{src}": state.entries(kind, src, meta)
            for src in cfg.kv_source_layer_ids
            for kind in ("kv", "index_k")
        }

    @jax.jit
    def both(state, kept):
        """(the chunk of t tokens then keep_accepted(kept), the chunk with lens = kept): buffers + entries."""
        meta = lambda lens: cache_lib.StepMetadata(
            start=jnp.asarray(start), lens=lens, slots=jnp.asarray(slots), page_tables=jnp.asarray(tables)
        )
        full = jnp.full((2,), t, jnp.int32)
        _, long, aux = forward(
            model.params,
            cfg,
            jnp.asarray(chunk),
            state,
            meta(full),
            jax.tree.map(jnp.asarray, engram),
            capture_chunk_state=True,
        )
        long = long.keep_accepted(state, meta(full), aux["chunk_state"], kept)
        _, short, _ = forward(
            model.params, cfg, jnp.asarray(chunk), state, meta(kept), jax.tree.map(jnp.asarray, engram)
        )
        return (_slot_buffers(long), visible_entries(long, kept)), (
            _slot_buffers(short),
            visible_entries(short, kept),
        )

    checked = 0
    for k in range(t + 1):
        kept = np.array([k, max(k - 1, 0)], np.int32)
        (long, long_entries), (short, short_entries) = both(engine.state, jnp.asarray(kept))
        flat_long = jax.tree_util.tree_flatten_with_path(long)[0]
        for (path, a), b in zip(flat_long, jax.tree.leaves(short), strict=True):
            name = jax.tree_util.keystr(path)
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"kept={kept.tolist()}: {name} differs"
            checked += 1
        # Page entries a later read can see (complete groups within the kept positions) agree too.
        for src in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[src]
            for kind in ("kv", "index_k"):
                a, b = np.asarray(long_entries[f"{kind}{src}"]), np.asarray(short_entries[f"{kind}{src}"])
                for row in range(2):
                    visible = (int(start[row]) + int(kept[row])) // r
                    assert np.array_equal(a[row, :visible], b[row, :visible]), f"{kind} {src} row {row} k={k}"
    assert checked > 0


@pytest.mark.slow  # compiles plain and speculative decoding of the tiny model (minutes on 2 cores)
def test_known_drafts_accept_and_stop(model):
    """Drafts equal to the greedy continuation are accepted in full; a wrong draft stops acceptance
    at its index and the token emitted there is the target's greedy choice; the emitted stream equals
    greedy decoding."""
    prompt = _prompt(7, 20)
    plain = model.generate(prompt, max_tokens=24, stop_at_eos=False)["token_ids"]
    k = 4
    session = model.new_session(1, 256, with_draft=True)
    logits, _ = session.step(np.array([prompt]))
    first = int(np.argmax(logits[0, -1]))
    assert first == plain[0]
    out = [first]
    # step 1: no drafts yet
    step = session.speculative_step(out[-1], np.zeros((1, k), np.int32), 0, 0.0, 0)
    assert int(step.accepted[0]) == 0
    out.append(int(step.tokens[0, 0]))
    # step 2: the true continuation as drafts -> all accepted, plus the next greedy token
    true = np.array([plain[len(out) : len(out) + k]], np.int32)
    step = session.speculative_step(out[-1], true, k, 0.0, 0)
    assert int(step.accepted[0]) == k
    out.extend(int(x) for x in step.tokens[0, : k + 1])
    # step 3: the true continuation with a wrong token at index 2
    wrong = np.array([plain[len(out) : len(out) + k]], np.int32)
    wrong[0, 2] = (wrong[0, 2] + 1) % model.cfg.vocab_size
    step = session.speculative_step(out[-1], wrong, k, 0.0, 0)
    assert int(step.accepted[0]) == 2
    out.extend(int(x) for x in step.tokens[0, :3])
    # then plain speculative steps with the model's own drafts
    drafts, n = step.next_drafts[:, :k], k
    while len(out) < len(plain):
        step = session.speculative_step(out[-1], drafts, n, 0.0, 0)
        out.extend(int(x) for x in step.tokens[0, : step.accepted[0] + 1])
        drafts = step.next_drafts[:, :k]
    assert out[: len(plain)] == plain


def test_rejection_sampling_follows_the_target(model):
    """The first token a speculative step emits follows p (the target's filtered distribution) for a
    draft q far from p, over 4096 seeds: chi-square over p's likely tokens below the 0.999 quantile;
    taking q's draws without the test would fail it."""
    cfg = model.cfg
    prompt = _prompt(11, 16)
    session = model.new_session(1, 64)
    logits, _ = session.step(np.array([prompt]))
    target = np.asarray(logits[0, -1], np.float32)
    rng = np.random.default_rng(0)
    draft_logits = target[rng.permutation(cfg.vocab_size)]  # same shape of distribution, other tokens
    n = 4096
    temperature = np.full(n, 0.8, np.float32)
    top_p = np.full(n, 0.95, np.float32)
    top_k = np.zeros(n, np.int32)
    seeds = np.arange(n, dtype=np.uint32)
    pos = np.full(n, len(prompt), np.int32)
    drafted, q = jax.jit(draft_token)(
        np.tile(draft_logits, (n, 1)), pos + 1, temperature, top_p, top_k, seeds
    )
    target_rows = np.tile(target, (n, 2, 1))  # index 0: after the input token; index 1: after the draft
    accepted, tokens, *_ = jax.jit(speculative_sample, static_argnames="num_logprobs")(
        target_rows, q[:, None], drafted[:, None], np.ones(n, np.int32), pos, temperature, top_p, top_k,
        seeds, None, num_logprobs=0,
    )  # fmt: skip
    first = np.asarray(tokens)[:, 0]
    p = np.asarray(jax.nn.softmax(filter_logits(target[None], temperature[:1], top_p[:1], top_k[:1])))[0]

    def chi_square(samples):
        likely = np.flatnonzero(p * n >= 5)
        counts = np.bincount(samples, minlength=cfg.vocab_size)
        observed = np.append(counts[likely], n - counts[likely].sum())
        expected = np.append(p[likely] * n, n * (1 - p[likely].sum()))
        keep = expected > 0
        return float(np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep])), int(keep.sum() - 1)

    from scipy.stats import chi2 as _chi2  # scipy is a dependency of jax

    stat, dof = chi_square(first)
    limit = float(_chi2.ppf(0.999, dof))
    assert 0 < int(np.sum(accepted)) < n, "some drafts accepted, some rejected"
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f} (dof {dof}): emitted tokens do not follow p"
    control, _ = chi_square(np.asarray(drafted))
    assert control > limit, f"control: q's own draws pass the test ({control:.1f} < {limit:.1f})"


def test_engine_refuses_without_stages(model):
    shapes = StateShapes(max_slots=1, page_size=16, num_pages=8, max_context=128)
    params = {k: v for k, v in model.params.items() if k != "mtp"}
    no_stages = dataclasses.replace(model.loaded, params=params)
    with pytest.raises(ValueError, match="no DSpark stages"):
        Engine(no_stages, shapes, with_draft=True)
    engine = Engine(model.loaded, shapes)
    with pytest.raises(ValueError, match="with_draft=True"):
        engine.speculative_decode(
            [0], [1], np.zeros((1, 2), np.int32), [0], [0], [True], np.zeros((1, 8), np.int32),
            SamplingBatch.broadcast(1), max_logprobs=0,
        )  # fmt: skip


@pytest.mark.slow  # compiles CED prefill, plain and speculative decoding of tiny-draft (minutes on 2 cores)
def test_speculative_greedy_after_a_ced_prefill_is_plain_greedy():
    """DSpark with CED prefill (issue 15.5): the draft stages' context comes from the prompt's last
    window only (the decoder layers run only there), and greedy speculative decoding still emits the
    plain greedy tokens of the same CED prefill; drafts are accepted (tiny-draft's draft agrees with
    its backbone), so the speculative path is exercised."""
    model = ced_jax.load("tiny-draft")
    prompt = _prompt(11, 5 * model.cfg.sliding_window)
    plain = model.generate(prompt, max_tokens=40, stop_at_eos=False, prefill_mode="ced")
    fast = model.generate(prompt, max_tokens=40, stop_at_eos=False, prefill_mode="ced", dspark=4)
    assert fast["token_ids"] == plain["token_ids"]
    assert fast["dspark"]["accepted"] > 0
