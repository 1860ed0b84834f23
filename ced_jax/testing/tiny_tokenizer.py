"""Builds the embedded tiny model's tokenizer: a byte-level BPE of 512 ids with the V4.1 special tokens.

Rebuild the assets (deterministic: the same files on every run) with

    python -m ced_jax.testing.tiny_tokenizer

which writes `ced_jax/assets/tiny/tokenizer.json` and `engram_token_map.json` and sets
`engram_compressed_vocab_size` in `config.json` to what the new map compresses to (the Engram hash
multipliers depend on that number, so config and map must agree).

Layout of the 512 ids:
  * 0..13   the V4.1 special tokens with their real spellings (api-surface 16.1). Ids 0..7 keep the
            ids the tiny config already names (BOS 0, EOS 1, pad 2, `<｜System｜>` 5 =
            dspark_noise_token_id, `<｜deepseek_image｜>` 7 = image_token_id); the rest follow.
  * 14..269 the 256 ByteLevel alphabet symbols, so every byte, and so every text, is representable.
  * 270..   BPE merges learnt by `tokenizers`' BpeTrainer on the fixed corpus below until 512.

Pre-tokenizer and decoder are ByteLevel with add_prefix_space false, as in DeepSeek's tokenizers.
The special tokens are added tokens (special, not normalised): `tokenizers` finds their spellings in
any text it encodes, including text a user typed (see `Model.encode`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512

# In id order. Ids 0..7 are those of the tiny config's bos/eos/pad, dspark_noise_token_id (5,
# `<｜System｜>` as in v41-flash) and image_token_id (7); changing them means changing config.json.
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜System｜>",
    "<think>",
    "<｜deepseek_image｜>",
    "<｜fim▁hole｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁end｜>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
)

# Written for this file (no download): English prose about the project, a little code and numbers,
# so the merges are ordinary English pieces (" the", " of", "ing", ...) and the ids look like a real
# tokenizer's. Any edit changes the merges, and with them every tiny-model output.
CORPUS = """\
The tiny model is a small random-weight copy of the layout of the large model. It has one layer of
each kind: a sliding window layer, a full attention layer with compression, a layer that reuses the
keys of an earlier layer, a layer that builds its own index, and the Engram layers that look up the
last few tokens in large tables. The weights are random, so the text it writes is not meant to be
read, but the shapes, the programs and the cache are the same as those of the real model.

A tokenizer turns the text of a prompt into token ids and the ids of the answer back into text.
This one works on the bytes of the text: every byte has a token of its own, so any text can be
written, and the most frequent pairs of tokens in the corpus were merged into longer tokens. The
first ids are the special tokens of the chat template: the beginning of the sentence, the end of
the sentence, the pad token, the user and the assistant turns, the system turn, the start and the
end of thinking, the image placeholder, the fill in the middle markers, the tool call marker and
the latest reminder.

Hello world. Hello, how are you? I am well, thank you. What is the time? It is ten past three.
The quick brown fox jumps over the lazy dog. She sells sea shells on the sea shore.
In the beginning was the word, and the word was with the model, and the model was the word.

To serve the model, start the server and send it a request with a prompt, the number of tokens to
generate, the temperature and the seed. The server batches the requests of many clients together,
runs the prefill of each prompt in chunks, and then runs one decode step for all of them at a time.
The pages of the cache hold the keys and the values of every token that was seen; when a request
ends, its pages return to the pool, and a prompt that starts with the same tokens as an earlier one
can reuse the pages of that prompt.

def generate(model, prompt, max_tokens=32, temperature=0.0, seed=0):
    ids = model.encode(prompt)
    for step in range(max_tokens):
        logits = model.forward(ids)
        token = sample(logits, temperature, seed, len(ids))
        ids.append(token)
        if token == model.eos_token_id:
            break
    return model.decode(ids)

for i in range(10):
    print(f"{i}: {i * i}")

1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096 8192 16384 65536
3.14159 2.71828 0.5 0.25 0.125 1e-5 1e-6 2024-01-01 12:30:45 100% 50% (a + b) * c = d; x[i] != y[j]

Questions and answers. Why is the sky blue? Because the air scatters the blue light of the sun more
than the red light. Why do we sleep? Nobody knows for sure, but the brain seems to need it to keep
the memories of the day. How far is the moon? About three hundred and eighty thousand kilometres.
What is the capital of France? Paris is the capital of France, and the largest city of the country.
"""


def build_tokenizer() -> Tokenizer:
    """The tiny tokenizer, trained from scratch on CORPUS (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(
            f"the corpus yields {tokenizer.get_vocab_size(with_added_tokens=True)} ids, not {VOCAB_SIZE}: "
            "it has too few distinct pairs; make CORPUS longer"
        )
    return tokenizer


def tokenizer_json() -> str:
    """tokenizer.json as written to the assets (pretty-printed, stable key order)."""
    return build_tokenizer().to_str(pretty=True) + "\n"


def write_assets(directory: Path) -> dict:
    """(Re)write tokenizer.json, engram_token_map.json and config.json's engram_compressed_vocab_size."""
    from ced_jax.engram_hash import build_token_map

    (directory / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    token_map = build_token_map(directory / "tokenizer.json")
    compressed = int(token_map.max()) + 1
    (directory / "engram_token_map.json").write_text(
        json.dumps({"compressed_vocab_size": compressed, "token_map": token_map.tolist()})
    )
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["engram_compressed_vocab_size"] = compressed
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return {"vocab_size": len(token_map), "engram_compressed_vocab_size": compressed}


def main() -> int:
    from ced_jax.config import ASSETS

    print(json.dumps(write_assets(ASSETS / "tiny")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
