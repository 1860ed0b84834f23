"""Engram hasher against DeepSeek's reference outputs (golden tiny-a) and its own invariants."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from ced_jax.config import ModelConfig, preset
from ced_jax.engram_hash import (
    DEAD,
    NO_HISTORY,
    EngramConfigError,
    EngramHasher,
    build_token_map,
    engram_primes,
    is_prime,
    load_token_map_file,
)
from tests.conftest import GOLDEN_TINY_A, REPO

MID = REPO / "bench" / "configs" / "mid"


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_pretrained(GOLDEN_TINY_A)


@pytest.fixture(scope="module")
def hasher(cfg):
    return EngramHasher.from_token_map_file(cfg, GOLDEN_TINY_A / "engram_token_map.json")


@pytest.fixture(scope="module")
def golden():
    inputs = json.loads((GOLDEN_TINY_A / "inputs.json").read_text())
    expected = load_file(str(GOLDEN_TINY_A / "expected.safetensors"))
    return inputs, expected


@pytest.mark.parametrize("directory", [GOLDEN_TINY_A, MID], ids=["tiny-a", "mid"])
def test_token_map_from_tokenizer_equals_reference_file(directory):
    built = build_token_map(directory / "tokenizer.json")
    stored = load_token_map_file(directory / "engram_token_map.json")
    np.testing.assert_array_equal(built, stored)
    # Both construction paths must accept the config's compressed vocab size.
    cfg = ModelConfig.from_pretrained(directory)
    from_tokenizer = EngramHasher.from_tokenizer_file(cfg, directory / "tokenizer.json")
    np.testing.assert_array_equal(from_tokenizer.token_map, stored)


def test_compressed_vocab_mismatch_is_rejected(cfg):
    wrong = cfg.replace(engram_compressed_vocab_size=cfg.engram_compressed_vocab_size + 1)
    with pytest.raises(EngramConfigError, match="engram_compressed_vocab_size"):
        EngramHasher.from_tokenizer_file(wrong, GOLDEN_TINY_A / "tokenizer.json")


def test_is_prime_matches_trial_division_and_large_cases():
    sieve = np.ones(5000, dtype=bool)
    sieve[:2] = False
    for i in range(2, 71):
        sieve[i * i:: i] = False
    assert [n for n in range(5000) if is_prime(n)] == np.flatnonzero(sieve).tolist()
    assert is_prime(2**61 - 1) and is_prime(2**64 - 59)
    # Strong pseudoprimes to many small bases must still be rejected.
    assert not is_prime(3215031751) and not is_prime(3825123056546413051)


@pytest.mark.parametrize(
    ("config", "rows"),
    [(lambda: preset("v41-flash"), [384006168, 384016682]), (lambda: preset("tiny"), [12458, 13416])],
    ids=["v41-flash", "tiny"],
)
def test_primes_sum_to_table_rows(config, rows):
    cfg = config()
    primes = engram_primes(cfg)
    assert primes.shape == (2, cfg.engram_max_ngram_size - 1, cfg.engram_n_heads)
    assert primes.reshape(2, -1).sum(axis=1).tolist() == rows
    assert len(set(primes.ravel().tolist())) == primes.size  # never reused
    assert primes.min() >= cfg.engram_vocab_size


def test_row_sum_mismatch_is_rejected(cfg):
    first, second = cfg.engram_num_embeddings
    wrong = cfg.replace(engram_num_embeddings=(first + 1, second))
    with pytest.raises(EngramConfigError, match="engram_num_embeddings"):
        EngramHasher.from_token_map_file(wrong, GOLDEN_TINY_A / "engram_token_map.json")


def test_offsets_are_exclusive_cumulative_sums(hasher):
    flat = hasher.primes.reshape(hasher.n_layers, -1)
    assert hasher.offsets[:, 0].tolist() == [0, 0]
    np.testing.assert_array_equal(hasher.offsets[:, 1:], np.cumsum(flat, axis=1)[:, :-1])


def test_prefill_matches_reference(hasher, golden):
    inputs, expected = golden
    prompt = np.array([inputs["prompt_ids"]])
    rows = hasher.hash_ids(hasher.empty_history(1), prompt)
    assert rows.dtype == np.int32 and rows.shape == (1, 100, 2, 12)
    np.testing.assert_array_equal(rows[0], expected["prefill_engram_hash_ids"])


def test_decode_steps_match_reference(hasher, golden):
    inputs, expected = golden
    prompt = np.array([inputs["prompt_ids"]])
    history = hasher.next_history(hasher.empty_history(1), prompt, np.array([prompt.shape[1]]))
    steps = []
    for token in inputs["decode_ids"]:
        step = np.array([[token]])
        steps.append(hasher.hash_ids(history, step)[0, 0])
        history = hasher.next_history(history, step, np.array([1]))
    np.testing.assert_array_equal(np.stack(steps), expected["decode_engram_hash_ids"])


def test_chunked_equals_one_shot_with_ragged_batch(hasher, golden):
    inputs, _ = golden
    prompt = np.array(inputs["prompt_ids"])
    whole = hasher.hash_ids(hasher.empty_history(1), prompt[None])[0]

    # Row 0: the prompt in chunks of 37, 1 and 62 tokens; row 1: a shorter sequence, padded with
    # arbitrary ids beyond its length, which must not leak into its history.
    other = prompt[::-1][:60]
    history = hasher.empty_history(2)
    pieces = [[], []]
    for start, stop in ((0, 37), (37, 38), (38, 100)):
        width = stop - start
        batch = np.full((2, width), 7, dtype=np.int64)
        batch[0] = prompt[start:stop]
        other_len = max(0, min(stop, len(other)) - start)
        batch[1, :other_len] = other[start: start + other_len]
        rows = hasher.hash_ids(history, batch)
        pieces[0].append(rows[0])
        pieces[1].append(rows[1, :other_len])
        history = hasher.next_history(history, batch, np.array([width, other_len]))
    np.testing.assert_array_equal(np.concatenate(pieces[0]), whole)
    np.testing.assert_array_equal(
        np.concatenate(pieces[1]), hasher.hash_ids(hasher.empty_history(1), other[None])[0]
    )


def _expected_row(hasher, compressed_window, layer=0, ngram=2, head=0):
    """Row id of one (layer, n-gram size, head) from compressed ids at shifts 0..K-1, by the definition."""
    products = [int(np.int64(c) * hasher.multipliers[layer, s]) for s, c in enumerate(compressed_window)]
    rolling = 0
    for value in products[:ngram]:
        rolling ^= value
    prime = int(hasher.primes[layer, ngram - 2, head])
    return rolling % prime + int(hasher.offsets[layer, (ngram - 2) * hasher.n_heads + head])


def test_dead_token_blocks_look_back(hasher):
    tokens = np.array([[40, 41, 42, 43, 44, 45]])
    dead = np.array([[False, False, True, False, False, False]])
    rows = hasher.hash_ids(hasher.empty_history(1), tokens, dead)
    plain = hasher.hash_ids(hasher.empty_history(1), tokens)
    compressed = hasher.token_map[tokens[0]]
    pad = hasher.pad_id

    # Position 4 sees 44, 43, then the dead token: shifts 2 and 3 are padded.
    for ngram in (2, 3, 4):
        col = (ngram - 2) * hasher.n_heads
        want = _expected_row(hasher, [compressed[4], compressed[3], pad, pad], ngram=ngram)
        assert rows[0, 4, 0, col] == want
    # Positions past the dead token's reach (5 looks back to 2 only at shift 3) and before it agree.
    np.testing.assert_array_equal(rows[0, :2], plain[0, :2])
    assert not np.array_equal(rows[0, 5], plain[0, 5])
    # A dead token carried in the history blocks the same way as one inside the chunk.
    history = hasher.next_history(hasher.empty_history(1), tokens[:, :3], np.array([3]), dead[:, :3])
    assert history[0].tolist() == [compressed[0], compressed[1], DEAD]
    np.testing.assert_array_equal(hasher.hash_ids(history, tokens[:, 3:]), rows[:, 3:])


def test_sequence_start_uses_pad(hasher):
    rows = hasher.hash_ids(hasher.empty_history(1), np.array([[40]]))
    c = int(hasher.token_map[40])
    pad = hasher.pad_id
    assert rows[0, 0, 1, hasher.n_heads * 2 + 3] == _expected_row(hasher, [c, pad, pad, pad], 1, 4, 3)


def test_bad_inputs_name_the_argument(hasher):
    history = hasher.empty_history(1)
    with pytest.raises(ValueError, match="tokens"):
        hasher.hash_ids(history, np.array([[len(hasher.token_map)]]))
    with pytest.raises(ValueError, match="tokens"):
        hasher.hash_ids(history, np.array([-1, 3]))
    with pytest.raises(ValueError, match="history"):
        hasher.hash_ids(hasher.empty_history(2), np.array([[3]]))
    with pytest.raises(ValueError, match="history"):
        hasher.hash_ids(np.array([[NO_HISTORY, 0, hasher.compressed_vocab_size]]), np.array([[3]]))
    with pytest.raises(ValueError, match="dead"):
        hasher.hash_ids(history, np.array([[3, 4]]), np.array([[True]]))
    with pytest.raises(ValueError, match="lens"):
        hasher.next_history(history, np.array([[3, 4]]), np.array([3]))
    with pytest.raises(ValueError, match="lens"):
        hasher.next_history(history, np.array([[3, 4]]), np.array([1, 1]))
