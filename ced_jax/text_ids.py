"""Token ids of a text through a `tokenizers.Tokenizer`, without holding the GIL.

`Tokenizer.encode` holds the GIL for the whole encoding (about a second for a megabyte of text), so
every other thread of a server, its event loop included, stands still meanwhile; `encode_batch`
releases it and gives the same ids. Every encoding of request text goes through here.
"""

from __future__ import annotations


def encode_ids(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
