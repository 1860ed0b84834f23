"""The embedded tiny model's tokenizer: a byte-level BPE that tokenizes any text and round-trips it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

import ced_jax
from ced_jax.config import ASSETS, preset
from ced_jax.engram_hash import EngramHasher, build_token_map, load_token_map_file
from ced_jax.testing.tiny_tokenizer import tokenizer_json

pytestmark = pytest.mark.timeout(120)

TINY = ASSETS / "tiny"
# api-surface 16.1, spelt out here rather than taken from the generator.
SPEC_SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜System｜>",
    "<｜fim▁hole｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁end｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜deepseek_image｜>",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


@pytest.fixture(scope="module")
def model():
    return ced_jax.load("tiny")  # no program is compiled: only encode / decode_text are used


def _round_trip(tok: Tokenizer, text: str) -> str:
    return tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)


def test_committed_assets_are_what_the_generator_builds():
    # The asset can be rebuilt: `python -m ced_jax.testing.tiny_tokenizer` writes these same bytes.
    assert (TINY / "tokenizer.json").read_text(encoding="utf-8") == tokenizer_json()
    stored = load_token_map_file(TINY / "engram_token_map.json")
    np.testing.assert_array_equal(build_token_map(TINY / "tokenizer.json"), stored)
    cfg = preset("tiny")
    assert cfg.engram_compressed_vocab_size == int(stored.max()) + 1
    # Both ways of building the hasher accept the config (the compressed vocab size must agree).
    EngramHasher.from_tokenizer_file(cfg, TINY / "tokenizer.json")
    EngramHasher.from_token_map_file(cfg, TINY / "engram_token_map.json")


def test_special_tokens_and_config_ids(tok):
    cfg = preset("tiny")
    raw = json.loads((TINY / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"]: t for t in raw["added_tokens"]}
    assert sorted(added) == sorted(SPEC_SPECIAL_TOKENS)
    assert all(t["special"] and not t["normalized"] for t in added.values())
    ids = {s: tok.token_to_id(s) for s in SPEC_SPECIAL_TOKENS}
    assert (ids["<｜begin▁of▁sentence｜>"], ids["<｜end▁of▁sentence｜>"], ids["<｜▁pad▁｜>"]) == (0, 1, 2)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)
    assert cfg.image_token_id == ids["<｜deepseek_image｜>"]
    assert cfg.dspark_noise_token_id == ids["<｜System｜>"]  # as in v41-flash (128799)
    assert max(ids.values()) < 32  # small ids in the tiny vocab
    config = json.loads((TINY / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert [config[k] for k in ("bos_token", "eos_token", "pad_token")] == SPEC_SPECIAL_TOKENS[:3]
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size == 512
    vocab = tok.get_vocab()
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)  # every byte has a token
    assert raw["model"]["type"] == "BPE" and len(raw["model"]["merges"]) == 512 - 256 - 14
    assert raw["pre_tokenizer"] == {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    assert raw["decoder"]["type"] == "ByteLevel"


def test_prompts_tokenize_into_different_ids(model):
    hello, other = model.encode("hello world"), model.encode("The quick brown fox")
    assert hello[0] == other[0] == 0  # BOS, written once by encode
    assert hello != other and len(hello) > 2 and len(other) > 2
    pad = model.cfg.pad_token_id
    assert pad not in hello[1:] and pad not in other[1:]
    assert len(model.encode("hello world " * 50)) > 50  # length limits on text can now be reached
    # Merges: a frequent English word is one token, not its letters.
    assert len(model.encode(" the")) == 2


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_any_text_round_trips(tok, text):
    assert _round_trip(tok, text) == text


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(codec="utf-8", categories=["Cc", "Zs", "Zl", "Zp", "Co", "Cf", "So"])))
def test_control_and_unusual_characters_round_trip(tok, text):
    assert _round_trip(tok, text) == text


def test_many_random_strings_round_trip_through_the_model_api(model):
    rng = random.Random(20240611)
    surrogates = range(0xD800, 0xE000)  # not text: UTF-8 cannot hold them
    for _ in range(300):
        chars = []
        for _ in range(rng.randrange(0, 40)):
            # ASCII, two-byte UTF-8 or any code point, in equal parts
            code = rng.choice((rng.randrange(0x80), rng.randrange(0x80, 0x800), rng.randrange(0x110000)))
            chars.append(chr(code if code not in surrogates else 0xFFFD))
        text = "".join(chars)
        ids = model.encode(text)
        assert ids[0] == 0 and all(0 <= i < 512 for i in ids)
        assert model.decode_text(ids[1:]) == text


def test_special_token_spellings_in_user_text_become_special_ids(model):
    # Documented behaviour of Model.encode (and so of the server, which encodes with it): the
    # `tokenizers` library matches added tokens anywhere in the text it encodes, so a typed
    # spelling becomes the special id, as in vLLM. decode_text skips special ids, so such text does
    # not round-trip through decode_text.
    ids = model.encode("x<｜end▁of▁sentence｜>y<think>")
    think = model.tokenizer.token_to_id("<think>")
    assert ids == [0, *model.encode("x")[1:], 1, *model.encode("y")[1:], think]
    assert model.decode_text(ids[1:]) == "xy"
    # A spelling that is not exactly a special token stays text.
    assert model.decode_text(model.encode("<｜end of sentence｜>")[1:]) == "<｜end of sentence｜>"
