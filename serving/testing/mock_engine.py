"""A hand-computable engine (and byte tokenizer) for scheduler and server tests; no model, no device.

The mock keeps a real paged KV buffer on the host (`kv[num_pages, page_size]` holding token ids) and
computes every next token from what it reads back through the page tables, so page-table, sharing and
prefix-cache bugs change the output. The most likely next token after a context `t[0..p-1]` is

    v = 7 * t[p-1] + 3 * p + (sum_i (i + 1) * t[i] mod 1_000_003) + 5 * sum(t[p-window:p])
    target = eos_id if eos_modulus and v % eos_modulus == 0 else token_lo + v % token_span

(`mock_target`). Logits put 0 on the target and fall by 0.7 per step around the ring of the
`token_span` allowed tokens (so temperature sampling has something to choose from); everything else is
-30. Tokens are drawn by the real sampler (`ced_jax/sampling.py`), under the requests' token masks
(constrained decoding), so unconstrained greedy streams are exactly `mock_greedy_stream` and seeded
streams exercise the production sampling code.

`replay_tokens=H` (> 0) emulates an engine with state outside the pages (V4.1's SWA rings): the
`window` term comes from a per-slot ring that only prefill/decode update, from the slot's
`window_floor` on, so resuming after a prefix hit is only correct when the scheduler replays at least
`window` cached tokens; a fresh slot must start at its window_floor, and positions before a chunk's
`write_from` are not written but checked against the pages (they must be the shared cached prefix).

The mock also checks the scheduler's side of the contract: contiguous positions, page-aligned chunk
starts, chunks within the buckets, one chunk per slot in a prefill batch, decode only on prefilled
slots, history tokens that match the pages. It computes at once (its `Pending`s are `Ready`) and logs
every prefill call's chunks (`prefill_log`), the slots of each batch (`prefill_batches`) and the
order of the calls (`calls`).

Speculative decoding (`dspark_widths`): a step with drafts writes the fed token and all `w` draft
positions into the pages (drafts past n_drafts as PAD), so a page table that does not cover
positions[s] + w corrupts whatever page it names. It verifies drafts by sampling each position with
the real sampler (key of its position, its mask row) and accepting a draft iff the sample equals it,
which is exact for greedy and sampled rows alike, so a stream's tokens are those of plain decoding.
The next drafts are the greedy continuation after the emitted tokens, except that draft j is wrong
when `(position of the draft + 3 * j) % draft_miss_every == 0` (`mock_drafts`), with confidence
+4 for right drafts and -4 for wrong ones; `draft_log` records each speculative row step as
(slot, width, n_drafts, emitted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence

import numpy as np

from ced_jax.inputs import SamplingBatch
from serving.engine.protocol import (
    CompileCounter,
    DecodeBatch,
    DecodeResult,
    EngineSpec,
    PrefillChunk,
    PrefillResult,
    Ready,
    mask_words,
)

_H_MOD = 1_000_003


class ByteTokenizer:
    """ids 0..2 are BOS, EOS, PAD; id 3 + b is byte b. Decoding replaces invalid UTF-8 with U+FFFD."""

    BOS, EOS, PAD, OFFSET = 0, 1, 2, 3
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(i - self.OFFSET for i in token_ids if self.OFFSET <= i < self.OFFSET + 256)
        return data.decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class MockRule:
    """Parameters of the next-token function."""

    eos_id: int = ByteTokenizer.EOS
    token_lo: int = ByteTokenizer.OFFSET + ord("a")
    token_span: int = 26
    window: int = 4
    eos_modulus: int = 0  # 0 = never EOS


def mock_target(context: Sequence[int], rule: MockRule, ring: Sequence[int] | None = None) -> int:
    """The most likely token after `context` (ring: the last `window` tokens, if kept separately)."""
    p = len(context)
    ctx = np.asarray(context, dtype=np.int64)
    h = int(np.sum((np.arange(p, dtype=np.int64) + 1) * ctx) % _H_MOD)
    last = ctx[-rule.window :] if ring is None else np.asarray(ring, dtype=np.int64)
    v = 7 * int(ctx[-1]) + 3 * p + h + 5 * int(np.sum(last))
    if rule.eos_modulus and v % rule.eos_modulus == 0:
        return rule.eos_id
    return rule.token_lo + v % rule.token_span


def mock_logits(target: int, rule: MockRule, vocab_size: int) -> np.ndarray:
    out = np.full(vocab_size, -30.0, np.float32)
    ring = np.arange(rule.token_span)
    if target == rule.eos_id:
        out[rule.token_lo + ring] = -1.0 - 0.7 * ring
        out[rule.eos_id] = 0.0
    else:
        out[rule.token_lo + (target - rule.token_lo + ring) % rule.token_span] = -0.7 * ring
    return out


def mock_drafts(
    context: Sequence[int], n: int, rule: MockRule, miss_every: int
) -> tuple[list[int], list[float]]:
    """The mock's n drafts after `context` (its last token included, not yet fed) and their
    confidences: the greedy continuation, with the draft at position p = len(context) + j replaced by
    the next token of the ring when (p + 3 * j) % miss_every == 0 (0: never)."""
    seq, drafts, conf = list(context), [], []
    for j in range(n):
        t = mock_target(seq, rule)
        p = len(seq)
        wrong = miss_every and (p + 3 * j) % miss_every == 0
        if wrong:
            t = (
                rule.token_lo + (t - rule.token_lo + 1) % rule.token_span
                if t != rule.eos_id
                else rule.token_lo
            )
        drafts.append(t)
        conf.append(-4.0 if wrong else 4.0)
        seq.append(t)
    return drafts, conf


def mock_greedy_stream(prompt: Sequence[int], n: int, rule: MockRule = MockRule()) -> list[int]:
    """The first n greedy tokens after `prompt` (ignoring EOS: generation continues past it)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(mock_target(seq, rule))
    return seq[len(prompt) :]


class MockEngine:
    """Implements `serving.engine.protocol.EngineProtocol` on numpy (see the module docstring)."""

    def __init__(
        self,
        *,
        max_slots: int = 8,
        page_size: int = 4,
        num_pages: int = 64,
        max_context: int = 64,
        prefill_buckets: Sequence[int] = (4, 8, 16),
        max_logprobs: int = 5,
        rule: MockRule = MockRule(),
        vocab_size: int = ByteTokenizer.vocab_size,
        replay_tokens: int = 0,
        history_tokens: int = 0,
        step_delay_s: float = 0.0,
        dspark_widths: Sequence[int] = (),
        dspark_max_drafts: int | None = None,
        draft_miss_every: int = 0,
        ced_window: int = 0,
        long_prefill_chunk: int = 0,
    ):
        self._spec = EngineSpec(
            max_slots=max_slots,
            page_size=page_size,
            num_pages=num_pages,
            max_context=max_context,
            prefill_buckets=tuple(prefill_buckets),
            vocab_size=vocab_size,
            eos_token_ids=(rule.eos_id,),
            max_logprobs=max_logprobs,
            replay_tokens=replay_tokens,
            history_tokens=history_tokens,
            model_name="mock",
            dspark_widths=tuple(dspark_widths),
            long_prefill_chunk=long_prefill_chunk,
            dspark_max_drafts=max(dspark_widths, default=0)
            if dspark_max_drafts is None
            else dspark_max_drafts,
            config_summary={"kind": "mock", "window": str(rule.window)},
            ced_window=ced_window,  # claims a CED layout (the mock's arithmetic ignores decoder_from)
            # A page's blob is its int32 token ids (KV tiers); the fingerprint names the rule.
            kv_page_bytes=page_size * 4,
        )
        self._kv_fingerprint = hashlib.blake2b(
            repr(("mock", rule, page_size)).encode(), digest_size=16
        ).digest()
        self.rule = rule
        self.step_delay_s = step_delay_s
        self.kv = np.full((num_pages, page_size), -1, np.int32)
        # Per-slot state the engine owns: next position to write (-1 = released) and the ring.
        self._pos = np.full(max_slots, -1, np.int64)
        self._decoding = np.zeros(max_slots, bool)
        self._ring: list[tuple[int, ...]] = [()] * max_slots
        self.prefill_log: list[tuple[int, int, int, int]] = []  # (slot, start, length, bucket)
        self.prefill_batches: list[tuple[int, ...]] = []  # the slots of each prefill_batch call
        self.calls: list[str] = []  # "prefill" / "decode", in the order they were dispatched
        self.decode_steps = 0
        self.draft_miss_every = draft_miss_every
        self.draft_log: list[tuple[int, int, int, int]] = []  # (slot, width, n_drafts, emitted)
        self.max_active_seen = 0  # largest number of rows decoded together
        self.pages_read = 0  # read_pages / write_pages (KV tiers)
        self.pages_written = 0
        self._compiles = CompileCounter()
        self._warm = False

    # ---- EngineProtocol -------------------------------------------------------------------------

    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def compiles_after_warmup(self) -> int:
        return self._compiles.count

    def warmup(self) -> None:
        from ced_jax.sampling import jitted_sample

        fn = jitted_sample(self._spec.max_logprobs)
        v = self._spec.vocab_size
        for rows in (1, self._spec.max_slots):
            out = fn(
                np.zeros((rows, v), np.float32),
                np.zeros(rows, np.int32),
                np.ones(rows, np.float32),
                np.ones(rows, np.float32),
                np.zeros(rows, np.int32),
                np.zeros(rows, np.uint32),
                self._all_ones(rows),
            )
            np.asarray(out[0])
        self._warm = True

    def prefill_async(self, chunks: Sequence[PrefillChunk]) -> Ready:
        if not chunks:
            raise ValueError("prefill_batch needs at least one chunk")
        slots = [c.slot for c in chunks]
        if len(set(slots)) != len(slots):
            raise ValueError(f"one chunk per slot in a prefill batch, got slots {slots}")
        if len(chunks) > 1 and any(len(c.token_ids) > self._spec.max_chunk for c in chunks):
            raise ValueError("a long chunk (above the largest prefill bucket) goes alone")
        self.prefill_batches.append(tuple(slots))
        self.calls.append("prefill")
        return Ready([self._prefill_one(c) for c in chunks])

    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> list[PrefillResult]:
        return self.prefill_async(chunks).result()

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        return self.prefill_batch([chunk])[0]

    def _prefill_one(self, chunk: PrefillChunk) -> PrefillResult:
        spec = self._spec
        s, start, toks = chunk.slot, chunk.start_pos, np.asarray(chunk.token_ids, np.int32)
        n = len(toks)
        longest = max(spec.max_chunk, spec.long_prefill_chunk)
        if not 1 <= n <= longest:
            raise ValueError(f"chunk length {n} outside 1..{longest}")
        if start % spec.page_size:
            raise ValueError(f"chunk start {start} is not page aligned")
        if start + n > spec.max_context:
            raise ValueError("chunk runs past max_context")
        fresh = self._pos[s] < 0
        if not 0 <= chunk.window_floor <= start or chunk.write_from % spec.page_size:
            raise ValueError(
                f"window_floor {chunk.window_floor} / write_from {chunk.write_from} out of place"
            )
        if fresh:
            if spec.replay_tokens and start != chunk.window_floor:
                raise ValueError(f"slot {s}: a fresh slot starts at its window_floor, not at {start}")
            self._ring[s] = ()
        elif self._pos[s] != start:
            raise ValueError(f"slot {s}: chunk starts at {start}, state is at {self._pos[s]}")
        if self._decoding[s]:
            raise ValueError(f"slot {s} is decoding")
        self._check_history(chunk)
        bucket = spec.long_prefill_chunk if n > spec.max_chunk else spec.bucket_for(n)
        self.prefill_log.append((s, start, n, bucket))
        cached = min(max(chunk.write_from - start, 0), n)  # a replay: those pages are shared
        if cached and not np.array_equal(self._read(chunk.page_table, start + cached)[start:], toks[:cached]):
            raise ValueError(
                f"slot {s}: replayed tokens [{start}, {start + cached}) differ from the cached pages"
            )
        self._write(chunk.page_table, start + cached, toks[cached:])
        self._ring[s] = (self._ring[s] + tuple(int(t) for t in toks))[-self.rule.window :]
        self._pos[s] = start + n
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if not chunk.is_last_chunk:
            return PrefillResult(token=None)
        self._decoding[s] = True
        logits = self._logits_for(s, chunk.page_table, start + n)[None]
        sp = chunk.sampling
        mask = self._all_ones(1) if chunk.token_bitmask is None else self._row_mask(chunk.token_bitmask)
        row = SamplingBatch.broadcast(1, sp.temperature, sp.top_p, sp.top_k, sp.seed, token_bitmask=mask)
        out = self._sample(logits, np.array([start + n], np.int32), row)
        return PrefillResult(token=out.row(0))

    def decode_async(self, batch: DecodeBatch) -> Ready:
        # Through `decode`, so a test that replaces `engine.decode` (a failing engine) is heard.
        self.calls.append("decode")
        return Ready(self.decode(batch))

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        if batch.drafts is not None:
            return self._speculative(batch)
        spec = self._spec
        S = spec.max_slots
        logits = np.zeros((S, spec.vocab_size), np.float32)
        for s in np.flatnonzero(batch.active):
            pos = int(batch.positions[s])
            if not self._decoding[s]:
                raise ValueError(f"decode on slot {s}, which has not finished prefill")
            if pos != self._pos[s]:
                raise ValueError(f"slot {s}: decode at {pos}, state is at {self._pos[s]}")
            if pos + 1 > spec.max_context:
                raise ValueError("decode past max_context")
            tok = np.array([batch.token_ids[s]], np.int32)
            self._write(batch.page_tables[s], pos, tok)
            self._ring[s] = (self._ring[s] + (int(tok[0]),))[-self.rule.window :]
            self._pos[s] = pos + 1
            logits[s] = self._logits_for(s, batch.page_tables[s], pos + 1)
        self.decode_steps += 1
        self.max_active_seen = max(self.max_active_seen, int(np.sum(batch.active)))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        sp = batch.sampling
        mask = self._all_ones(S) if sp.token_bitmask is None else np.asarray(sp.token_bitmask, np.int32)
        return self._sample(logits, batch.positions + 1, dataclasses.replace(sp, token_bitmask=mask))

    def _speculative(self, batch: DecodeBatch) -> DecodeResult:
        spec = self._spec
        S, w, kmax, N = spec.max_slots, batch.draft_width, spec.dspark_max_drafts, spec.max_logprobs
        if w not in spec.dspark_widths:
            raise ValueError(f"draft width {w} is not one of the engine's {spec.dspark_widths}")
        drafts, n_drafts = (np.asarray(a, np.int32) for a in (batch.drafts.drafts, batch.drafts.n_drafts))
        W = mask_words(spec.vocab_size)
        sp = batch.sampling
        masks = sp.token_bitmask
        if masks is not None and np.shape(masks) != (S, w + 1, W):
            raise ValueError(f"token_bitmask shape {np.shape(masks)}, expected {(S, w + 1, W)}")
        out_tok = np.zeros((S, w + 1), np.int32)
        out_lp = np.zeros((S, w + 1), np.float32)
        out_ids = np.zeros((S, w + 1, N), np.int32)
        out_tlp = np.zeros((S, w + 1, N), np.float32)
        emitted = np.ones(S, np.int32)
        next_drafts = np.zeros((S, kmax), np.int32)
        next_conf = np.zeros((S, kmax), np.float32)
        for s in np.flatnonzero(batch.active):
            pos, k = int(batch.positions[s]), int(n_drafts[s])
            if not self._decoding[s] or pos != self._pos[s]:
                raise ValueError(f"slot {s}: decode at {pos}, state is at {self._pos[s]}")
            if not 0 <= k <= w:
                raise ValueError(f"slot {s}: n_drafts {k} outside 0..{w}")
            if pos + w >= spec.max_context:
                raise ValueError(f"slot {s}: draft block [{pos}, {pos + w}] runs past max_context")
            fed = np.concatenate([[batch.token_ids[s]], drafts[s, :k], np.full(w - k, ByteTokenizer.PAD)])
            self._write(batch.page_tables[s], pos, fed.astype(np.int32))  # every position, like a device
            ring = self._ring[s]
            for j in range(k + 1):
                ring = (ring + (int(fed[j]),))[-self.rule.window :]
                self._ring[s] = ring
                logits = self._logits_for(s, batch.page_tables[s], pos + j + 1)[None]
                mask = self._all_ones(1) if masks is None else np.asarray(masks[s, j], np.int32)[None]
                row = SamplingBatch(sp.temperature[s : s + 1], sp.top_p[s : s + 1], sp.top_k[s : s + 1],
                                    sp.seed[s : s + 1], mask)  # fmt: skip
                r = self._sample(logits, np.array([pos + j + 1]), row)
                out_tok[s, j], out_lp[s, j] = r.token_ids[0], r.logprobs[0]
                out_ids[s, j], out_tlp[s, j] = r.top_ids[0], r.top_logprobs[0]
                emitted[s] = j + 1
                if j == k or r.token_ids[0] != fed[j + 1]:
                    break
            e = int(emitted[s])
            self._pos[s] = pos + e
            context = list(self._read(batch.page_tables[s], pos + e)) + [int(out_tok[s, e - 1])]
            d, c = mock_drafts(context, kmax, self.rule, self.draft_miss_every)
            next_drafts[s], next_conf[s] = d, c
            self.draft_log.append((int(s), w, k, e))
        self.decode_steps += 1
        self.max_active_seen = max(self.max_active_seen, int(np.sum(batch.active)))
        return DecodeResult(
            token_ids=out_tok, logprobs=out_lp, top_ids=out_ids, top_logprobs=out_tlp,
            emitted=emitted, next_drafts=next_drafts, next_confidence=next_conf,
        )  # fmt: skip

    def release(self, slot: int) -> None:
        self._pos[slot] = -1
        self._decoding[slot] = False
        self._ring[slot] = ()

    def kv_fingerprint(self) -> bytes:
        return self._kv_fingerprint

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        self.pages_read += len(pages)
        return [self.kv[p].tobytes() for p in self._page_ids(pages)]

    def write_pages(self, pages: Sequence[int], blobs: Sequence[bytes]) -> None:
        ids = self._page_ids(pages)
        if len(set(ids.tolist())) != len(ids) or len(blobs) != len(ids):
            raise ValueError(f"write_pages: {len(blobs)} blobs for pages {ids.tolist()} (distinct, one each)")
        ps = self._spec.page_size
        for p, blob in zip(ids, blobs, strict=True):
            if len(blob) != ps * 4:
                raise ValueError(f"write_pages: a blob of {len(blob)} bytes, a page is {ps * 4}")
            self.kv[p] = np.frombuffer(blob, np.int32)
        self.pages_written += len(ids)

    # ---- internals ----------------------------------------------------------------------------

    def _page_ids(self, pages: Sequence[int]) -> np.ndarray:
        ids = np.asarray(pages, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self._spec.num_pages):
            raise ValueError(f"pages outside 0..{self._spec.num_pages - 1}: {ids.tolist()}")
        return ids

    def _write(self, page_table: np.ndarray, start: int, toks: np.ndarray) -> None:
        ps = self._spec.page_size
        pos = np.arange(start, start + len(toks))
        self.kv[np.asarray(page_table)[pos // ps], pos % ps] = toks

    def _read(self, page_table: np.ndarray, length: int) -> np.ndarray:
        """Tokens at positions [0, length), read through the page table."""
        ps = self._spec.page_size
        pos = np.arange(length)
        return self.kv[np.asarray(page_table)[pos // ps], pos % ps]

    def _check_history(self, chunk: PrefillChunk) -> None:
        h = self._spec.history_tokens
        if not h:
            return
        expect = self._read(chunk.page_table, chunk.start_pos)[-h:] if chunk.start_pos else np.zeros(0)
        if not np.array_equal(np.asarray(chunk.history), expect):
            raise ValueError(f"history {chunk.history} does not match the pages ({expect})")

    def _logits_for(self, s: int, page_table: np.ndarray, length: int) -> np.ndarray:
        context = self._read(page_table, length)
        ring = self._ring[s] if self._spec.replay_tokens else None
        return mock_logits(mock_target(context, self.rule, ring), self.rule, self._spec.vocab_size)

    @staticmethod
    def _row_mask(row: np.ndarray) -> np.ndarray:
        return np.asarray(row, np.int32)[None]

    def _all_ones(self, rows: int) -> np.ndarray:
        return np.full((rows, mask_words(self._spec.vocab_size)), -1, np.int32)

    def _sample(self, logits, positions, sampling: SamplingBatch) -> DecodeResult:
        """The engine's sampler on these rows (`sampling.token_bitmask` given)."""
        from ced_jax.sampling import jitted_sample

        fn = jitted_sample(self._spec.max_logprobs)
        sp = sampling
        args = (
            logits,
            positions.astype(np.int32),
            sp.temperature,
            sp.top_p,
            sp.top_k,
            sp.seed,
            sp.token_bitmask,
        )
        if self._warm:
            with self._compiles.watch():
                out = fn(*args)
        else:
            out = fn(*args)
        tok, lp, ids, tlp = (np.asarray(x) for x in out)
        return DecodeResult(token_ids=tok, logprobs=lp, top_ids=ids, top_logprobs=tlp)
