"""A token's results do not depend on the chunk length or on the other rows of the batch.

Speculative decoding verifies K drafted tokens in one [B, K+1] step, and its greedy output must be
token for token the output of one-token [B, 1] steps; a server batch must not change a stream's
tokens. So `forward` must compute every (row, position) with the same arithmetic whatever B and T
(see `ced_jax.invariant.matmul_rows` and `ced_jax.model.layers.attention.window_segment_by_position`). On the
tiny model (bf16 rounding at every block boundary, so a one-ulp f32 difference anywhere shows up as
a 2^-9 jump in some block) the results are compared bit for bit:
- a 48-token greedy continuation decoded one token at a time vs the same sequence teacher-forced in
  chunks of 5 (the last chunk padded, lens < T);
- three different sequences in one batch of 3 (chunks of 5) vs each row alone, one token at a time;
- a 256-token prompt as one chunk vs in chunks of 5: from about 256 rows on XLA:CPU hands reduce
  fusions to YNNPACK, which has its own exp (the notebook API's long chunks vs the server's pages).
Every program here is one of four shapes ([1, 1], [1, 5], [3, 5], [1, 256]) to keep compilation short.
The first check runs with impl="reference" and with impl="cpu" (the CPU kernels, `pallas_kernels._cpu`).
"""

from __future__ import annotations

import numpy as np
import pytest

import ced_jax

CHUNK = 5
PROMPT_LEN = 20  # a multiple of CHUNK: every prompt goes in through the [B, 5] program
NEW_TOKENS = 48
LONG = 256  # tokens of the one-chunk prompt
MAX_LEN = 256  # one cache shape for every session of the module (the programs are shared)


@pytest.fixture(scope="module", params=["reference", "cpu"])
def model(request):
    """The XLA path, and the CPU kernels (impl="cpu": the routed experts through the FP4 kernel, the
    stored FP8 linears through the FP8 one, the indexer's scores through its own)."""
    return ced_jax.load("tiny", impl=request.param)


def _prompt(seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, size=PROMPT_LEN)]


def _feed_chunks(session, rows: list[list[int]]):
    """Teacher-force equal-length sequences in chunks of CHUNK (the last one padded):
    (logits [B, n, V], block outputs [L, B, n, M, D]) for every fed position."""
    n = len(rows[0])
    logits, blocks = [], []
    for s in range(0, n, CHUNK):
        piece = np.zeros((len(rows), CHUNK), np.int32)
        valid = min(CHUNK, n - s)
        piece[:, :valid] = [r[s : s + valid] for r in rows]
        out, aux = session.step(piece, np.full(len(rows), valid, np.int32), capture_blocks=True)
        logits.append(out[:, :valid])
        blocks.append(aux["block_output"][:, :, :valid])
    return np.concatenate(logits, 1), np.concatenate(blocks, 2)


def _decode_alone(model, prompt: list[int]):
    """Prompt in chunks, then NEW_TOKENS greedy tokens one [1, 1] step at a time: (the sequence fed
    after the prompt, logits [n, V] and block outputs [L, n, M, D] of every decoded position, the
    first being the prompt's last position)."""
    session = model.new_session(1, MAX_LEN)
    logits, blocks = _feed_chunks(session, [prompt])
    step_logits, step_blocks = [logits[0, -1]], [blocks[:, 0, -1]]
    fed = []
    while len(fed) < NEW_TOKENS:
        fed.append(int(np.argmax(step_logits[-1])))
        out, aux = session.step(np.array([[fed[-1]]], np.int32), capture_blocks=True)
        step_logits.append(out[0, 0])
        step_blocks.append(aux["block_output"][:, 0, 0])
    return fed, np.stack(step_logits[1:]), np.stack(step_blocks[1:], 1)


@pytest.fixture(scope="module")
def alone(model):
    return [_decode_alone(model, _prompt(seed)) for seed in range(1)]


@pytest.fixture(scope="module")
def reference_model():
    """The slow checks' model: the XLA path only (the CPU kernel's rows are independent by its
    construction and checked against its blocked reference, tests/pallas_kernels/test_cpu_kernels.py)."""
    return ced_jax.load("tiny")


@pytest.fixture(scope="module")
def reference_alone(reference_model):
    return [_decode_alone(reference_model, _prompt(seed)) for seed in range(3)]


def _assert_bit_identical(got, want, what):
    assert got.shape == want.shape, what
    diff = np.abs(got.astype(np.float64) - want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
        f"{what}: {int(np.sum(got != want))} values differ, at most {diff.max():.3g}"
    )


def test_chunks_of_five_match_one_token_steps(model, alone):
    fed, want_logits, want_blocks = alone[0]
    assert len(set(fed)) > 5, "a degenerate continuation would hide position-dependent errors"
    session = model.new_session(1, MAX_LEN)
    _feed_chunks(session, [_prompt(0)])
    logits, blocks = _feed_chunks(session, [fed])
    _assert_bit_identical(blocks[:, 0], want_blocks, "block outputs, chunks of 5 vs one token")
    _assert_bit_identical(logits[0], want_logits, "logits, chunks of 5 vs one token")


@pytest.mark.slow  # a third program shape ([3, 5]) to compile: minutes on 2 cores
def test_batch_rows_match_each_row_alone(reference_model, reference_alone):
    model, alone = reference_model, reference_alone
    assert len({tuple(fed) for fed, _, _ in alone}) == 3
    session = model.new_session(3, MAX_LEN)
    _feed_chunks(session, [_prompt(seed) for seed in range(3)])
    logits, blocks = _feed_chunks(session, [fed for fed, _, _ in alone])
    for row, (_, want_logits, want_blocks) in enumerate(alone):
        _assert_bit_identical(blocks[:, row], want_blocks, f"block outputs of row {row}, batch of 3")
        _assert_bit_identical(logits[row], want_logits, f"logits of row {row}, batch of 3")


@pytest.mark.slow  # a fourth program shape ([1, 256]) to compile: minutes on 2 cores
def test_one_long_chunk_matches_chunks_of_five(reference_model):
    model = reference_model
    prompt = [int(x) for x in np.random.default_rng(7).integers(3, 500, size=LONG)]
    session = model.new_session(1, MAX_LEN)
    logits, aux = session.step(np.array([prompt], np.int32), capture_blocks=True)
    want_logits, want_blocks = _feed_chunks(model.new_session(1, MAX_LEN), [prompt])
    blocks = aux["block_output"][:, 0]
    _assert_bit_identical(blocks, want_blocks[:, 0], "block outputs, one chunk of 256 vs chunks of 5")
    _assert_bit_identical(logits[0], want_logits[0], "logits, one chunk of 256 vs chunks of 5")
