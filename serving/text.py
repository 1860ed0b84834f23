"""Tokenizers, incremental detokenization and stop strings (host side, pure Python).

`StreamText` turns a request's sampled tokens into the (token_ids, text) deltas a client sees. Its
invariants:
- Text is never cut inside a character: a token that ends in an incomplete UTF-8 sequence (the
  tokenizer decodes it to U+FFFD) is held until the character completes, or until 4 more tokens show it
  never will (a UTF-8 character spans at most 4 bytes).
- A stop string is matched on the decoded text, so it may span any number of tokens. Text that could
  still turn out to be the start of a stop string is held back; when a stop string appears, the text
  before it is released and nothing from the stop string on ever is.
- Tokens are released together with their text: a token is released once all text up to and including
  it has been released. On a stop, tokens whose text reaches into the stop string are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ced_jax.text_ids import encode_ids

_REPLACEMENT = "\ufffd"
_MAX_UTF8_TOKENS = 4


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """Adapts a `tokenizers.Tokenizer` (tokenizer.json) to the `Tokenizer` protocol."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        from tokenizers import Tokenizer as _HF

        return cls(_HF.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # The tokenizer's own post-processor decides about BOS, so Tokenize and Generate agree.
        return encode_ids(self._tok, text, add_special_tokens=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence.

    Decodes a short window (the previous delta's tokens plus the new ones) rather than the whole
    sequence, and compares against the window's old text: byte-level and SentencePiece decoders depend
    on neighbouring tokens (merged bytes, leading-space rules), so single tokens cannot be decoded alone.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self._tok = tokenizer
        # A few tokens of left context (the prompt's tail) so the first delta decodes as it would
        # inside the sequence. Invariant: self._ids[:self._read] were already turned into text.
        self._ids: list[int] = list(context)[-_MAX_UTF8_TOKENS:]
        self._read = len(self._ids)

    @property
    def pending(self) -> int:
        """Pushed tokens not yet turned into text (an incomplete character)."""
        return len(self._ids) - self._read

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        old = self._tok.decode(self._ids[: self._read])
        new = self._tok.decode(self._ids)
        pending = len(self._ids) - self._read
        if not force and new.endswith(_REPLACEMENT) and pending < _MAX_UTF8_TOKENS:
            return ""  # the last character is still incomplete
        # The window's old text was sent already; decoders only append when tokens are appended.
        delta = new[len(old) :]
        # The tokens just turned into text become the next window's left context.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return delta


@dataclasses.dataclass
class Released:
    token_ids: list[int]
    text: str
    payloads: list  # one per released token (e.g. its logprobs), same order as token_ids
    stopped: bool = False  # a stop string was found; the request must finish


class StreamText:
    """Per-request output buffer: detokenizes, matches stop strings, releases tokens with their text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()):
        self._detok = IncrementalDetokenizer(tokenizer, context)
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""  # decoded but not yet released
        self._checked = 0  # self._text[:_checked] holds no complete stop string
        # (token, end offset of its text in _text or None while its character is incomplete, payload)
        self._pending: list[tuple[int, int | None, object]] = []
        self.stopped = False

    def push(self, token_id: int, payload: object = None) -> Released:
        if self.stopped:
            raise RuntimeError("push after a stop string matched")
        self._text += self._detok.push(token_id)
        self._pending.append((token_id, None, payload))
        self._resolve(self._detok.pending)
        return self._release(final=False)

    def finish(self) -> Released:
        """Flushes everything held back (the request ended for another reason than a stop string)."""
        if self.stopped:
            return Released([], "", [])
        self._text += self._detok.flush()
        self._resolve(0)
        return self._release(final=True)

    def _resolve(self, unresolved: int) -> None:
        """Tokens whose text is now decoded end at the current end of the text."""
        end = len(self._text)
        for i in range(len(self._pending) - unresolved):
            t, e, p = self._pending[i]
            if e is None:
                self._pending[i] = (t, end, p)

    def _release(self, final: bool) -> Released:
        cut = len(self._text)
        stop_at = self._find_stop()
        if stop_at is not None:
            self.stopped = True
            cut = stop_at
        elif not final:
            cut -= self._holdback()
        text = self._text[:cut]
        n = 0
        while n < len(self._pending) and self._pending[n][1] is not None and self._pending[n][1] <= cut:
            n += 1
        done = self._pending[:n]
        if self.stopped:
            self._pending = []
            self._text = ""
        else:
            self._pending = [(t, None if end is None else end - cut, p) for t, end, p in self._pending[n:]]
            self._text = self._text[cut:]
            self._checked = max(0, self._checked - cut)
        return Released([t for t, _, _ in done], text, [p for _, _, p in done], stopped=self.stopped)

    def _find_stop(self) -> int | None:
        if not self._stops:
            return None
        # Text before `_checked` was searched already; a new match must end after it.
        start = max(0, self._checked - self._max_stop + 1)
        best = None
        for s in self._stops:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best = i
        self._checked = len(self._text)
        return best

    def _holdback(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(len(text), self._max_stop - 1), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
