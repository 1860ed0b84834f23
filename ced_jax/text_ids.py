"""Token ids of a text through a `tokenizers.Tokenizer`, without holding the GIL."""

from __future__ import annotations


def encode_ids(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    # `Tokenizer.encode` holds the GIL for the whole encoding (about a second for a megabyte of text),
    # stopping every other thread of a server, its event loop included; `encode_batch` releases it
    # and gives the same ids. Every encoding of request text goes through here.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
