"""The device-engine interface that the host scheduler drives (JetStream's Engine/orchestrator split).

An engine owns the device side: weights, a static-shape paged KV buffer, per-slot state, and one
compiled program per shape (a prefill program per bucket length and one decode program). The scheduler
(`serving/scheduling/scheduler.py`) owns everything else: which request sits in which slot, which
pages it holds, the prefix cache, stop conditions and text. The engine never allocates pages or sees
a request id.

Shapes are static, so nothing compiles after `warmup()`:
- `max_slots` decode slots; `decode` is handed a `[max_slots]` batch, inactive rows masked (an
  engine may run only the active rows, e.g. JaxEngine's decode buckets).
- `num_pages` pages of `page_size` tokens; each slot has a page table of `pages_per_slot` entries
  (`max_context / page_size`), one row of `page_tables[max_slots, pages_per_slot]` on the host.
- a prefill chunk is padded to the smallest of `prefill_buckets` that holds it; the scheduler never
  sends a chunk longer than `max(prefill_buckets)`, but for one alone of at most
  `long_prefill_chunk` tokens when the engine has that (a long prompt while nothing decodes).
  `prefill_batch` takes the chunks of several
  slots at once (at most `max(ServeConfig.prefill_rows)`; JaxEngine compiles one program per
  `prefill_rows` size and pads a call to the smallest that holds it).

Lifecycle of a slot, as seen by the engine:
1. `prefill_batch(chunks)` one or more times (one chunk of the slot per call, positions contiguous).
   Every chunk starts at a page boundary (`start_pos % page_size == 0`; the scheduler cuts every
   chunk but a prompt's last at a page boundary). The first chunk starts at 0, or at a prefix-cache
   hit (see below). It writes the chunk's KV into the pages named by the page table. The chunk with
   `is_last_chunk` samples the first generated token.
2. `decode(batch)` many times: each active row feeds its last token at `positions[s]`, writes its KV,
   and samples the token at `positions[s] + 1`.
3. `release(slot)`: the request finished, was aborted or was cancelled. The slot's per-slot state
   (SWA ring, compressor buffers, ...) is dead; its pages are reused by other slots at once, so the
   engine must never read a page position at or beyond the sequence length it was given (mask on
   length; freed pages are not zeroed).

Prefix cache. The scheduler shares pages of full prompt blocks between requests (hash chain over
page-aligned token blocks, `serving/scheduling/pages.py`). Resuming a sequence at a page boundary `b` may need
more than the pages before `b`; for DeepSeek-V4.1 it needs the SWA rings of every layer (and the
Engram n-gram history, token ids the scheduler has). Nothing but the pages is kept: the engine
rebuilds the rest by replaying cached tokens (spec 4.2, "encoder SWA bounded replay").
`EngineSpec.replay_tokens` H (a multiple of page_size) says how many:
- H = 0: pages alone are enough. The first chunk simply starts at `b` (it also receives the
  `history_tokens` tokens before `b`, for n-gram features).
- H > 0: the first chunk starts at s = max(0, b - H) on a fresh slot, with `window_floor` s (no
  per-slot state before it exists) and `write_from` b (the pages before b are the shared cached ones
  and must not be written), as does every later chunk of the request. The engine recomputes
  [s, b) only to rebuild its per-slot state; the scheduler counts those tokens as prefill work.
Either way a hit must give exactly the logits of a cold run.

KV tiers (`serving/scheduling/kv_tiers.py`, `ServeConfig.kv_host_bytes` / `kv_disk_dir`). An engine whose
`EngineSpec.kv_page_bytes` is > 0 can copy whole pages out of and into its state:
`read_pages(pages)` returns one blob of `kv_page_bytes` per page (what persists of a cached block:
its compressed KV and index keys, `ced_jax.engine.page_io.PageLayout`), `write_pages(pages, blobs)` puts
them back. The scheduler reads the pages of the blocks the prefix cache evicts right after the
allocation that evicted them, before any engine call that writes them, and writes restored blocks
into freshly allocated pages before the prefill that continues them. A block restored into pages must
serve like the block computed there (in restore mode "pages": the first chunk starts after it).
`kv_fingerprint()` names the page layout and every weight byte, so a disk tier written by another
model, checkpoint or config is refused (computed on the first call: it may read the checkpoint once).

Asynchrony. `decode_async` and `prefill_async` only dispatch the work and return a `Pending`
whose `result()` waits for it (JAX dispatch is asynchronous), so the scheduler dispatches a step's
decode, then its prefill, and prepares their inputs and handles the decode's tokens while the device
runs them; calls take effect in the order they were made. `decode`, `prefill_batch` and `prefill`
are the same calls, waited for.

Sampling is part of the engine's compiled programs (`ced_jax/sampling.py`): per-row parameters arrive as
arrays, the key for the token at absolute position `p` is `fold_in(PRNGKey(seed), p)`, so a request's
tokens depend only on its own seed, positions and logits, never on what else is in the batch.
Constrained decoding (`serving/constraints.py`): each row of a decode step, and the sample of a last
prefill chunk, comes with a packed token mask (i32[W], W = ceil(vocab_size / 32), bit j of word w set
<=> token 32 w + j allowed; `None` or all ones = unconstrained) that the sampler applies before
temperature, top-k/top-p and greedy; the masks are computed on the host by the scheduler. An all-ones
row leaves the logits as they are, so unconstrained rows are unaffected by constrained neighbours,
and the mask's shape never changes (no recompiles).
Top-n log-probabilities are always computed for `max_logprobs` alternatives (a static shape); the
scheduler slices what a request asked for.

Speculative decoding (DSpark, `EngineSpec.dspark_widths` non-empty). A decode step may carry drafts:
`DecodeBatch.drafts` i32[S, w] (w one of `dspark_widths`, static per call) and `n_drafts` i32[S] in
0..w, the previous step's `next_drafts` of each row (0 right after prefill: no drafts yet). Row s
feeds `token_ids[s]` at `positions[s]` and drafts[s, :n_drafts[s]] after it, verifies them against
the target and returns `emitted[s]` = 1 + accepted tokens (`token_ids[s, :emitted[s]]`: the
accepted drafts, then one token sampled from the target), plus `next_drafts` / `next_confidence` for
the next step. The state afterwards holds positions < positions[s] + emitted[s]; the next step feeds
`token_ids[s, emitted[s] - 1]` at `positions[s] + emitted[s]`. The engine may write KV for every
position up to positions[s] + w (page tables cover them: the scheduler reserves the pages); positions
past what it accepted are garbage beyond the sequence length, overwritten before they are read.
Greedy rows accept a draft iff it is the target's argmax, sampled rows by rejection sampling with the
same (seed, position) keys, so greedy output is token-for-token that of plain decoding. The token mask
is then [S, w + 1, W]: mask j is the one of the token sampled after drafts 0..j-1 were accepted (the
scheduler truncates n_drafts at the first draft its grammar forbids). Without drafts (`drafts`
None) a step is exactly the plain decode program, whatever `dspark_widths` says.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ced_jax.inputs import DraftInputs, SamplingBatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling parameters. temperature == 0 means greedy; top_k == 0 and top_p == 1 mean off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # uint32

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 <= self.seed < 2**32):
            raise ValueError(f"seed must be a uint32, got {self.seed}")


def check_shapes(
    *,
    max_slots: int,
    page_size: int,
    num_pages: int,
    max_context: int,
    prefill_buckets: tuple[int, ...],
    named: Callable[[str], str] = str,
) -> None:
    """The rules every engine's shapes obey, for `EngineSpec` and `serving.config.ServeConfig` alike
    (ValueError naming the field as `named` spells it: ServeConfig's with its flag)."""
    for name, value in (
        ("max_slots", max_slots),
        ("page_size", page_size),
        ("num_pages", num_pages),
        ("max_context", max_context),
    ):
        if value < 1:
            raise ValueError(f"{named(name)} must be >= 1, got {value}")
    page = f"{named('page_size')} {page_size}"
    if max_context % page_size:
        raise ValueError(f"{named('max_context')} must be a multiple of {page}, got {max_context}")
    b = prefill_buckets
    if not b or list(b) != sorted(set(b)) or b[0] < 1:
        raise ValueError(f"{named('prefill_buckets')} must be ascending, each >= 1, got {b}")
    if b[-1] % page_size:
        raise ValueError(
            f"the largest of {named('prefill_buckets')} must be a multiple of {page}, got {b[-1]}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """The static shapes and model facts an engine was built with."""

    max_slots: int
    page_size: int
    num_pages: int
    max_context: int  # tokens per sequence; a multiple of page_size
    prefill_buckets: tuple[int, ...]  # ascending chunk lengths; the largest is a multiple of page_size
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int  # top-n alternatives computed for every sampled token
    # Cached tokens before a prefix hit that prefill replays (module docstring); 0 = pages suffice.
    replay_tokens: int = 0
    history_tokens: int = 0  # tokens before a chunk's start that prefill receives (n-gram features)
    model_name: str = ""
    config_summary: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Images: the model's width (span rows are [span_len, hidden_size]) and its image placeholder id;
    # hidden_size 0 = the model has no vision tower (requests with images are refused).
    hidden_size: int = 0
    image_token_id: int = -1
    # Speculative decoding: the draft widths w the engine has a compiled verify program for (a
    # DecodeBatch's drafts are [S, w]); () = no DSpark (plain decode only). `dspark_max_drafts`: the
    # length of the next_drafts a speculative step returns (the model's draft block size).
    dspark_widths: tuple[int, ...] = ()
    dspark_max_drafts: int = 0
    # CED prefill: the window of prompt tokens a "ced" request runs through the decoder layers (the
    # model's sliding window); 0 = the model has no CED layout (requests are exact only).
    ced_window: int = 0
    # KV tiers: the bytes of one page that `read_pages` / `write_pages` move (0 = the engine cannot
    # move pages: no KV tiers); what identifies their layout and weights is `Engine.kv_fingerprint()`.
    kv_page_bytes: int = 0
    # Data-parallel attention: the slots and the pages form `kv_blocks` equal blocks, one per device,
    # and a slot's pages must come from its own block (slot s is in block s // (max_slots /
    # kv_blocks), page p in block p // (num_pages / kv_blocks)). 1 = any page serves any slot.
    kv_blocks: int = 1
    # Long prompts: a prefill call may hold one text chunk (no image spans) of more than max_chunk
    # and at most this many tokens, alone (JaxEngine's one-row long program); 0 = never. The
    # scheduler sends one only while no stream is decoding (`ServeConfig.long_prefill_chunk`).
    long_prefill_chunk: int = 0

    def __post_init__(self):
        check_shapes(
            max_slots=self.max_slots,
            page_size=self.page_size,
            num_pages=self.num_pages,
            max_context=self.max_context,
            prefill_buckets=self.prefill_buckets,
        )
        if self.kv_blocks < 1 or self.max_slots % self.kv_blocks or self.num_pages % self.kv_blocks:
            raise ValueError(
                f"max_slots ({self.max_slots}) and num_pages ({self.num_pages}) must be multiples of the "
                f"{self.kv_blocks} devices attention is data-parallel over (one equal block each)"
            )
        if self.replay_tokens < 0 or self.replay_tokens % self.page_size:
            raise ValueError(
                f"replay_tokens must be a multiple of page_size {self.page_size} (>= 0), "
                f"got {self.replay_tokens}"
            )
        long_chunk = self.long_prefill_chunk
        if long_chunk and (
            long_chunk <= self.max_chunk or long_chunk % self.page_size or long_chunk > self.max_context
        ):
            raise ValueError(
                f"long_prefill_chunk must be 0 or a multiple of page_size {self.page_size} above the "
                f"largest prefill bucket {self.max_chunk} and at most max_context {self.max_context}, "
                f"got {long_chunk}"
            )
        w = tuple(self.dspark_widths)
        if w and (list(w) != sorted(set(w)) or w[0] < 1 or w[-1] > self.dspark_max_drafts):
            raise ValueError(
                f"dspark_widths must be ascending in 1..dspark_max_drafts ({self.dspark_max_drafts}), got {w}"
            )

    @property
    def dspark_width(self) -> int:
        """The widest draft block a step may verify; 0 = no speculative decoding."""
        return self.dspark_widths[-1] if self.dspark_widths else 0

    @property
    def pages_per_slot(self) -> int:
        return self.max_context // self.page_size

    @property
    def max_chunk(self) -> int:
        return self.prefill_buckets[-1]

    def bucket_for(self, length: int) -> int:
        """The prefill bucket a chunk of `length` tokens is padded to."""
        for b in self.prefill_buckets:
            if length <= b:
                return b
        raise ValueError(f"chunk of {length} tokens exceeds the largest prefill bucket {self.max_chunk}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillChunk:
    """One prefill call: `token_ids` at positions [start_pos, start_pos + len) of `slot`."""

    slot: int
    token_ids: np.ndarray  # i32[T], 1 <= T <= max(prefill_buckets)
    start_pos: int  # a multiple of page_size
    page_table: np.ndarray  # i32[pages_per_slot]; entries past the sequence are unspecified
    history: np.ndarray  # i32[<= history_tokens], the tokens right before start_pos (raw ids)
    sampling: SamplingParams
    is_last_chunk: bool  # sample the token at start_pos + T
    # The history's token types (-1 text, 0..3 image span; None = all text): image-span positions
    # are dead in an n-gram history.
    history_types: np.ndarray | None = None  # i32[len(history)]
    # A prefix hit's replay (module docstring): the first position the request computes (its first
    # chunk's start; 0 for a cold request) and the end of the cached pages it shares (not written).
    window_floor: int = 0
    write_from: int = 0
    token_bitmask: np.ndarray | None = None  # i32[W] for the last chunk's sample; None = all ones
    # Image spans in the chunk (both or neither; None = text only): the token type of every position
    # (-1 text, 0..3 span) and the embedding rows of span positions (others are ignored).
    token_types: np.ndarray | None = None  # i32[T]
    span_embeds: np.ndarray | None = None  # f32[T, hidden_size]
    # CED prefill ("ced" requests): the prompt's decoder layers run from this position on (prompt
    # length - EngineSpec.ced_window); the chunk's tokens before it run only the encoder layers. 0:
    # exact prefill.
    decoder_from: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampledToken:
    token_id: int
    logprob: float  # of token_id under the raw distribution
    top_ids: np.ndarray  # i32[max_logprobs], most likely first
    top_logprobs: np.ndarray  # f32[max_logprobs]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillResult:
    token: SampledToken | None  # set iff the chunk was the last one


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBatch:
    """Arrays of one decode step; all rows are [max_slots], inactive rows hold don't-care values."""

    active: np.ndarray  # bool[S]
    token_ids: np.ndarray  # i32[S], the last token of each sequence
    positions: np.ndarray  # i32[S], absolute position of token_ids; the new token lands at +1
    page_tables: np.ndarray  # i32[S, pages_per_slot]
    # Each row's temperature, top_p, top_k, seed [S] and token_bitmask i32[S, W] (with drafts
    # [S, w + 1, W]; None = all ones), numpy: what the engine's programs take, as they take it.
    sampling: SamplingBatch
    # Speculative decoding (module docstring): drafts [S, w] with w in EngineSpec.dspark_widths and
    # n_drafts [S]; None = a plain decode step.
    drafts: DraftInputs | None = None

    @property
    def draft_width(self) -> int:
        """w, the drafts per row this step may verify (0 = a plain decode step)."""
        return 0 if self.drafts is None else self.drafts.width


def mask_words(vocab_size: int) -> int:
    """W, the int32 words of one token-mask row (`DecodeBatch.token_bitmask`)."""
    return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeResult:
    """One packed host copy per step; rows of inactive slots are garbage.

    A plain step has one token per row (token_ids [S], ...). A speculative step (`emitted` set) has
    up to w + 1 per row: token_ids [S, w + 1], logprobs [S, w + 1], top_* [S, w + 1, max_logprobs],
    of which row s emits the first emitted[s]; and the row's drafts for the next step."""

    token_ids: np.ndarray  # i32[S] (speculative: [S, w + 1])
    logprobs: np.ndarray  # f32[S] (speculative: [S, w + 1])
    top_ids: np.ndarray  # i32[S, max_logprobs] (speculative: [S, w + 1, max_logprobs])
    top_logprobs: np.ndarray  # f32[S, max_logprobs] (speculative: [S, w + 1, max_logprobs])
    emitted: np.ndarray | None = None  # i32[S], 1 + accepted drafts; None = a plain step
    next_drafts: np.ndarray | None = None  # i32[S, dspark_max_drafts]
    next_confidence: np.ndarray | None = None  # f32[S, dspark_max_drafts]; sigmoid = est. acceptance

    def row(self, s: int) -> SampledToken:
        """The one token of row s of a plain step."""
        if self.emitted is not None:
            raise ValueError("a speculative step's row has several tokens: use tokens(s)")
        return SampledToken(
            token_id=int(self.token_ids[s]),
            logprob=float(self.logprobs[s]),
            top_ids=self.top_ids[s],
            top_logprobs=self.top_logprobs[s],
        )

    def tokens(self, s: int) -> list[SampledToken]:
        """The tokens row s emitted, in order (one for a plain step)."""
        if self.emitted is None:
            return [self.row(s)]
        return [
            SampledToken(
                token_id=int(self.token_ids[s, j]),
                logprob=float(self.logprobs[s, j]),
                top_ids=self.top_ids[s, j],
                top_logprobs=self.top_logprobs[s, j],
            )
            for j in range(int(self.emitted[s]))
        ]


@runtime_checkable
class Pending(Protocol):
    """Work an engine has dispatched; `result()` waits for it (once; later calls return the same)."""

    def result(self) -> Any: ...


class Ready:
    """A `Pending` that is already done (engines that compute on the host)."""

    def __init__(self, value: Any):
        self._value = value

    def result(self) -> Any:
        return self._value


@runtime_checkable
class EngineProtocol(Protocol):
    """What the scheduler needs from a device engine. All calls come from the scheduler's one thread."""

    @property
    def spec(self) -> EngineSpec: ...

    def kv_fingerprint(self) -> bytes:
        """16 bytes naming the page layout, config and weights (KV tiers: `kv_page_bytes` > 0)."""
        ...

    @property
    def compiles_after_warmup(self) -> int:
        """Programs compiled (or loaded from the persistent cache) by engine calls after warmup()."""
        ...

    def warmup(self) -> None:
        """Compiles every program variant (all prefill buckets, decode, each DSpark width) before serving."""
        ...

    def prefill_async(self, chunks: Sequence[PrefillChunk]) -> Pending:
        """Dispatches one chunk of each of several distinct slots; `result()`: list[PrefillResult],
        one per chunk in order."""
        ...

    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> list[PrefillResult]:
        """`prefill_async(chunks).result()`."""
        ...

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        """`prefill_batch([chunk])[0]`."""
        ...

    def decode_async(self, batch: DecodeBatch) -> Pending:
        """Dispatches a decode step; `result()`: its DecodeResult."""
        ...

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        """`decode_async(batch).result()`."""
        ...

    def release(self, slot: int) -> None: ...

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        """One `spec.kv_page_bytes` blob per page, as the state holds it now (module docstring)."""
        ...

    def write_pages(self, pages: Sequence[int], blobs: Sequence[bytes]) -> None:
        """Puts `blobs` (from `read_pages`, possibly of an earlier process) into distinct `pages`."""
        ...


class CompileCounter:
    """Counts the executables JAX builds on this thread inside `watch()`: fresh compiles and loads from
    the persistent compilation cache alike (`count`), and of those the loads (`loaded`).

    JAX reports every executable it builds through the `/jax/core/compile/backend_compile_duration`
    monitoring event on the compiling thread, a cache load after a `/jax/compilation_cache/cache_hits`
    event. Engines wrap their serving calls in `watch()`, so compiles from other threads (tests, other
    engines) are not counted. One process-wide listener dispatches to the counter active on the thread.
    """

    _EVENT = "/jax/core/compile/backend_compile_duration"
    _HIT = "/jax/compilation_cache/cache_hits"
    _active = threading.local()
    _installed = False
    _install_lock = threading.Lock()

    def __init__(self):
        self.count = 0
        self.loaded = 0
        self.compile_seconds = 0.0  # building the fresh executables
        self.load_seconds = 0.0  # loading the others from the cache
        self._install()

    @property
    def fresh(self) -> int:
        """Executables compiled (not loaded from the cache)."""
        return self.count - self.loaded

    def reset(self) -> None:
        self.count = self.loaded = 0
        self.compile_seconds = self.load_seconds = 0.0

    @classmethod
    def _install(cls):
        with cls._install_lock:
            if cls._installed:
                return
            import jax.monitoring

            def on_duration(event: str, duration: float, **kwargs):
                counter = getattr(cls._active, "counter", None)
                if event == cls._EVENT and counter is not None:
                    counter.count += 1
                    if getattr(cls._active, "hit", False):  # the cache-hit event came just before
                        cls._active.hit = False
                        counter.loaded += 1
                        counter.load_seconds += duration
                    else:
                        counter.compile_seconds += duration

            def on_event(event: str, **kwargs):
                if event == cls._HIT:
                    cls._active.hit = True

            jax.monitoring.register_event_duration_secs_listener(on_duration)
            jax.monitoring.register_event_listener(on_event)
            cls._installed = True

    @contextmanager
    def watch(self) -> Iterator[None]:
        prev = getattr(self._active, "counter", None)
        self._active.counter = self
        try:
            yield
        finally:
            self._active.counter = prev
