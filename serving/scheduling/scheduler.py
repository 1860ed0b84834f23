"""Host-side continuous batching over a static-shape paged engine (pure Python/numpy, no JAX).

This module keeps the request lifecycle and the step loop that dispatches to the engine; its parts
live beside it: `validation.py` (a request's checks), `placement.py` (the pages and slot an admitted
request takes, segment yields), `prefill.py` (a step's prefill chunks), `prefix.py` (the prefix
cache over the device pages and the KV tiers), `speculation.py` (DSpark drafts).

Request lifecycle (one request = one `_Seq`):
1. `submit` (any thread): checks the in-flight limit (running + queued, else `AdmissionError`
   "queue_full" -> RESOURCE_EXHAUSTED), a duplicate id and shutdown, then puts the request in the inbox.
   Field validation (`validate`) happens before that, so a bad request never takes a place.
2. Waiting: FIFO. At the start of every scheduler step the head of the queue is admitted when a slot is
   free, `max_running` allows, and pages for its whole worst case (prompt + max_tokens) can be
   reserved. Reserving up front means a running request never runs out of pages, so nothing is ever
   preempted for memory. The prefix cache supplies the prompt's leading full blocks (never the block
   holding the last prompt token: the first generated token needs that token's logits). A hit of b
   tokens is resumed at max(0, b - `EngineSpec.replay_tokens`): the engine replays those cached
   tokens to rebuild its per-slot state (`serving.engine.protocol`'s module docstring); they count
   against the prefill budget, while usage's cached_prompt_tokens reports b.
3. Prefill: one `engine.prefill_async` per step over the chunks of up to max(`prefill_rows`)
   prefilling requests (oldest first), `prefill_token_budget` prompt tokens in all while any stream
   is decoding (it bounds how long they wait), else every row's largest chunk (nobody waits), or,
   when the oldest prefilling request has more than a chunk of text left and the engine has a
   long-prompt program (`EngineSpec.long_prefill_chunk`), that request alone in one long chunk;
   the budget is handed out a
   page per request in turn (so a batch's chunks are about equally long: the engine runs as many
   page iterations as its longest chunk has pages); each chunk is at most the largest bucket and
   starts on a page boundary. After each chunk, the prompt blocks it completed are registered in
   the prefix cache. The last chunk samples the first token.
4. Decode: one `engine.decode_async` per step over all slots whose prefill is done. A request whose
   prefill finishes in a step joins the decode of the next one.
   A step is mixed: the decode is dispatched first, then the prefill is planned and dispatched
   while the device runs the decode (JAX dispatch is asynchronous: the host's Engram hashing,
   padding and page tables of the prefill overlap the decode), then the decode's tokens are handled
   (text, stop checks, events) while the device runs the prefill, and the prefill's results last.
   So an arrival holds up the running streams by at most one budget of prefill per step, never by
   its whole prompt. Overlap (`ServeConfig.overlap_schedule`, on by default): a plain decode step's
   tokens are taken at the start of the next step, after its admission round (which so runs while
   the device computes); only what decides the next step's rows is handled at once (a stop token,
   the last of max_tokens, a grammar's next mask: those requests are finished or masked first), the
   other tokens are recorded as the next step's inputs, the next decode and the prefill are
   dispatched, and only then are those tokens handled (text, stop strings, events) while the device
   runs them. A request that leaves its slot meanwhile (a stop string, an abort, a deadline, a
   yield) has a row in the step in flight: its result is dropped (`overlap_dropped_rows`); the KV
   that row writes lies past the request's registered blocks, in pages the device writes in
   dispatch order, so a later owner's writes come after it. Speculative steps are never overlapped.
   What cannot overlap: the next step's decode is dispatched only once this step's tokens are on
   the host, because its inputs need them there: the Engram hash rows of a token are int64 hashing
   of the n-gram ending at it, done on the host (`ced_jax.engram_hash`, as the spec places it).
   Flow control (`ServeConfig.decode_segment_tokens` N > 0): after admission, when requests are still
   waiting, each decoding request that has generated N tokens since it got its slot (most first)
   yields its slot, one at a time until the waiting requests are admitted: the full blocks of its
   prompt + output so far are registered in the prefix cache, its slot and pages are released, and
   it queues again at the back with prompt + output as its prompt. Readmitted, it prefills what the
   prefix cache does not hold (with the engine's replay, like any hit) and samples its next
   token from that prompt's last position: the token a decode step would have sampled there (the
   sampler's key is (seed, position), and the forward is chunk-invariant), so its stream goes on
   with the same tokens. Its stream state (text, grammar, counts, the CED decoder window of its
   original prompt) stays; usage reports the original prompt and the first admission's cached
   tokens. So a request with a huge max_tokens cannot monopolise a slot while others wait; alone,
   it never yields.
5. Finish (stop token, stop string, max_tokens/context, abort, cancel, deadline): the slot and every
   page reference are released in the same step, before the next engine call; the final event carries
   the finish reason and usage. A request that finished normally first registers the full blocks of
   its prompt + output in the prefix cache (the next turn of a conversation starts with them).

Threading: `step()` is only ever called by one thread (the scheduler thread from `start()`, or a test).
Other threads touch only the inbox, the abort list and the live-request table, under `self._lock`.
Events go to a per-request sink; `submit_async` makes one that hands events to an asyncio loop with
`loop.call_soon_threadsafe`, so the device loop never runs on the event loop.

Tenants: a request's `identity` (`serving/tenants.py`) namespaces its id: in-flight requests are keyed
by (identity, request_id), so two tenants may use the same id, a duplicate is one within a tenant, and
`abort` only finds the caller's own requests. The prefix cache is scoped by identity too
(`serving/scheduling/pages.py`), unless `ServeConfig.share_prefix_cache`.

Constrained decoding (`serving/constraints.py`): a request with a `constraint` gets a grammar matcher
when it is submitted (a constraint that cannot be compiled is an InvalidRequest naming the field).
The scheduler keeps a packed token-mask row per slot (all ones for unconstrained slots) and hands it
to the engine with every decode step and with a prompt's last prefill chunk. A request's matcher
consumes each token as it arrives (`_on_token`), and the rows of every request that got a token are
filled together, in one parallel llguidance call, right before the next engine dispatch
(`_fill_masks`). Overlapped steps handle a constrained request's token before the next dispatch
(step 4 above), so every mask is up to date when it is sent. A request whose grammar is complete
finishes with STOP (EOS is only allowed where the grammar may end); a grammar that rejects a
token (which the mask prevents; a resource limit could still cause it) ends the request with an
error event.

Speculative decoding (DSpark, `ServeConfig.dspark` K > 0; see `serving/engine/protocol.py`): every
decode step sends each row's drafts from the previous step (none right after its prefill) and how
many to verify: n_drafts = min(K, the drafts it has, max_tokens left - 1), with
`dspark_confidence` T the longest prefix whose running product of sigmoid(confidence) stays >= T
(at least 1), cut at the first draft its grammar forbids. The step's width is the smallest draft
width the engine compiled that holds every row's n_drafts (at least 1, since the step also drafts
the next block). A row emits 1 + accepted tokens per step; each goes through `_on_token` in order,
so EOS, stop ids, stop strings, a complete grammar and max_tokens apply per token, and the tokens
after the one that finishes the request are dropped. Pages: the engine may write KV at up to
width positions past a row's last token, so a request reserves pages for prompt + max_tokens - 1
+ K positions at admission (at most max_context); positions past the accepted length stay in the
request's pages and are overwritten later, and everything goes back at finish as usual. A step
whose width no row's pages can hold (a request within K of max_context) narrows to a width they
hold, or is a plain decode step. Output constraints: the masks of a row's K + 1 positions come from
advancing its matcher through the drafts and rolling it back (`ConstraintMatcher.fill_draft_masks`);
the emitted tokens are then consumed as usual. The pipelining of step 4 is unchanged: a step's
drafts and token are the previous step's results, so the next decode is dispatched only once they
are on the host (it could not be dispatched earlier even without the Engram hashing).

KV tiers (`ServeConfig.kv_host_bytes`, `kv_disk_dir`; `serving/scheduling/kv_tiers.py`), step 6 of a request's
life in the prefix cache: the device cache evicts unreferenced blocks (LRU) only inside the
allocation of an admission; the scheduler then reads their pages out of the engine
(`EngineProtocol.read_pages`, before this step's prefill rewrites them) and demotes them to host
memory, which pushes its own LRU blocks to disk. Admission matches the prompt against the device
cache and continues the chain into the lower tiers (`TieredKV.chain`): those blocks are written into
the request's freshly allocated pages (`EngineProtocol.write_pages`), registered in the device cache
again and count as cached prompt tokens, so the prefill starts after them exactly as after a device hit. A
request's disk blocks are prefetched into host memory when it enters the queue. On shutdown every
block of the device cache is demoted and the host tier is written to disk, so a restart with the same
directory finds the whole cache there (blocks of another model or config are refused by their
fingerprint, `EngineProtocol.kv_fingerprint()`).

Token accounting: a sampled stop token (EOS or `stop_token_ids`) is counted in `completion_tokens` but
never sent; a stop string is cut from the text (see `serving/text.py`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from ced_jax.inputs import DraftInputs, SamplingBatch
from serving.config import ServeConfig
from serving.constraints import ConstraintMatcher, ConstraintTokenizer
from serving.engine.protocol import (
    DecodeBatch,
    EngineProtocol,
    PrefillChunk,
    SampledToken,
    mask_words,
)
from serving.errors import AdmissionError
from serving.metrics import Metrics
from serving.requests import (
    FinishReason,
    GenerationRequest,
    Sink,
    StreamEvent,
    TokenLogprobs,
    Usage,
)
from serving.scheduling.kv_tiers import TieredKV
from serving.scheduling.pages import ROOT_KEY
from serving.scheduling.placement import FreeSlots, reserved_pages, yield_order
from serving.scheduling.prefill import chunk_images, plan_prefill
from serving.scheduling.prefix import TieredPrefixCache
from serving.scheduling.speculation import DraftBook, check_emitted
from serving.scheduling.streams import RequestStream
from serving.scheduling.validation import check_request, constraint_matcher
from serving.text import Released, StreamText, Tokenizer

log = logging.getLogger(__name__)


class _Seq:
    """Scheduler-thread state of one request."""

    def __init__(
        self,
        req: GenerationRequest,
        sink: Sink,
        arrival: float,
        max_tokens: int,
        text: StreamText,
        cache_scope: str,
        matcher: ConstraintMatcher | None = None,
    ):
        self.req = req
        self.matcher = matcher  # the constraint's grammar state, if the request has one
        self.live_key = (req.identity, req.request_id)
        self.cache_scope = cache_scope  # prefix-cache scope: the identity, or "" when the cache is shared
        self.sink = sink
        self.arrival = arrival
        self.prompt = np.asarray(req.prompt_token_ids, np.int32)  # + the output, after a yield
        self.prompt_len = len(self.prompt)  # the request's own prompt (usage)
        self.output_ids: list[int] = []  # every sampled token (after a yield, the prompt goes on with them)
        self.admissions = 0
        self.segment_from = 0  # `generated` when it last got a slot (decode_segment_tokens)
        self.decoder_from = 0  # CED: where its decoder layers start (fixed at the first admission)
        self.images = req.images
        self.max_tokens = max_tokens
        self.text = text
        self.slot: int | None = None
        self.pages: list[int] = []
        self.cached_tokens = 0
        self.prefilled = 0  # prompt tokens computed (a hit resumes before its cached tokens: replay)
        self.registered = 0  # prompt blocks registered in (or taken from) the prefix cache
        self.parent_key = ROOT_KEY
        # A prefix hit's replay: the first position this request computes and the end of the cached
        # pages it shares (both 0 for a cold start); every chunk carries them.
        self.window_floor = 0
        self.write_from = 0
        self.decoding = False
        self.generated = 0
        self.accepted_drafts = 0  # DSpark drafts the target accepted for this request
        self.last_token = -1
        self.pos = -1  # position of last_token
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.done = False
        self.deadline_exceeded = False


class Scheduler:
    def __init__(
        self,
        engine: EngineProtocol,
        tokenizer: Tokenizer,
        config: ServeConfig,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        constraint_tokenizer: ConstraintTokenizer | None = None,
    ):
        """constraint_tokenizer: llguidance's view of the model's tokenizer, for requests with a
        `constraint`; by default the tokenizer's own `constraint_tokenizer()` if it has one
        (`serving.engine.jax_engine.ModelTokenizer`). Without one, constrained requests are refused."""
        spec = engine.spec
        config.check_engine(spec)
        self.engine = engine
        self.spec = spec
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        # When this step's last device result reached the host, and when the step's first work was
        # dispatched (time.perf_counter): the device's idle time between steps, seen from the host.
        self._results_at: float | None = None
        self._dispatched_at: float | None = None
        self._idle_before: float | None = None
        self._outstanding = 0  # dispatched engine calls whose results the host has not taken yet
        # Overlap scheduling (ServeConfig.overlap_schedule): the plain decode step in flight, taken
        # at the next step: (active, pending, the request of each active slot at dispatch).
        self._inflight: tuple[np.ndarray, object, list[tuple[int, _Seq, int]]] | None = None
        self.overlap_dropped_rows = 0  # rows of overlapped steps whose request had left its slot
        self.clock = clock
        self.prefix = TieredPrefixCache(engine, config, metrics)
        self.pool = self.prefix.pool
        self._eos = frozenset(spec.eos_token_ids)
        S, P = spec.max_slots, spec.pages_per_slot
        self.page_tables = np.zeros((S, P), np.int32)
        self._slots: list[_Seq | None] = [None] * S
        self._free_slots = FreeSlots(S, spec.kv_blocks)
        self._tokens = np.zeros(S, np.int32)
        self._positions = np.zeros(S, np.int32)
        # Each slot's sampling parameters and next token's mask (all ones = unconstrained): the rows of
        # every decode step's `SamplingBatch`.
        self._sampling = SamplingBatch.broadcast(
            S, token_bitmask=np.full((S, mask_words(spec.vocab_size)), -1, np.int32)
        )
        self._bitmask = self._sampling.token_bitmask
        self._masks_due: list[_Seq] = []  # constrained requests whose row needs their next token's mask
        self._dspark = config.dspark  # K: drafts a row may verify, positions it may write past its token
        self._drafts = DraftBook(spec, config.dspark, config.dspark_confidence)
        self._constraint_tokenizer, self._no_constraints = constraint_tokenizer, ""
        if constraint_tokenizer is None:
            make = getattr(tokenizer, "constraint_tokenizer", None)
            try:
                self._constraint_tokenizer = make() if make is not None else None
            except Exception as e:  # unconstrained serving goes on; constrained requests say why not
                log.exception("no constrained decoding: the tokenizer could not be loaded for it")
                self._no_constraints = f" ({type(e).__name__}: {e})"
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        # Shared with other threads, under _lock.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[_Seq] = []
        self._aborts: list[_Seq] = []
        self._live: dict[tuple[str, str], _Seq] = {}  # (identity, request_id) -> request
        self._admitting = True
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        if metrics is not None:
            metrics.slots_total.set(S)

    # ---- any thread ---------------------------------------------------------------------------

    def validate(self, req: GenerationRequest) -> int:
        """Raises InvalidRequest naming the field or limit; returns the effective max_tokens."""
        return self._validate(req)[0]

    def _validate(self, req: GenerationRequest) -> tuple[int, ConstraintMatcher | None]:
        """`validate`, and the matcher of the request's constraint (compiling it is its check)."""
        max_tokens = check_request(req, self.config, self.spec)
        return max_tokens, constraint_matcher(req, self._constraint_tokenizer, self._no_constraints)

    def submit(self, req: GenerationRequest, sink: Sink) -> object:
        """Queues a request; raises InvalidRequest or AdmissionError at once, never blocks.

        Returns an opaque handle for `abort(..., handle=)`, which only aborts this very request even
        if its id is reused after it finished.
        """
        max_tokens, matcher = self._validate(req)
        text = StreamText(self.tokenizer, req.stop, context=req.prompt_token_ids)
        scope = "" if self.config.share_prefix_cache else req.identity
        seq = _Seq(req, sink, self.clock(), max_tokens, text, scope, matcher)
        with self._lock:
            if self._failed is not None:
                raise AdmissionError("engine_failed", f"the engine failed: {self._failed}")
            if not self._admitting:
                self._reject("shutting_down")
                raise AdmissionError("shutting_down", "the server is shutting down")
            if seq.live_key in self._live:
                self._reject("duplicate_id")
                raise AdmissionError("duplicate_id", f"request_id {req.request_id!r} is already in flight")
            limit = self.config.running_limit + self.config.max_queued
            if len(self._live) >= limit:
                self._reject("queue_full")
                raise AdmissionError(
                    "queue_full",
                    f"{len(self._live)} requests in flight; the limit is max_running + max_queued = {limit} "
                    "(--max-running, --max-queued)",
                )
            self._live[seq.live_key] = seq
            self._inbox.append(seq)
            self._wake.notify()
        return seq

    def submit_async(self, req: GenerationRequest) -> RequestStream:
        """Submits from a running asyncio loop; events arrive through the returned async iterator."""
        stream = RequestStream(self.abort, req.request_id, req.identity, asyncio.get_running_loop())
        stream._handle = self.submit(req, stream._sink)
        return stream

    def abort(self, request_id: str, handle: object | None = None, *, identity: str = "") -> bool:
        """Aborts `identity`'s in-flight request (finish_reason abort); False if it has none with this id.

        Another tenant's request with the same id is neither found nor touched.
        """
        with self._lock:
            seq = self._live.get((identity, request_id))
            if seq is None or (handle is not None and seq is not handle):
                return False
            self._aborts.append(seq)
            self._wake.notify()
            return True

    def abort_all(self) -> int:
        with self._lock:
            seqs = list(self._live.values())
            self._aborts.extend(seqs)
            self._wake.notify()
            return len(seqs)

    def stop_admitting(self) -> None:
        with self._lock:
            self._admitting = False

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        """Runs `step()` on a dedicated thread until `shutdown()`."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(target=self._loop, name="ced-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Aborts whatever is in flight, then stops the scheduler thread."""
        self.stop_admitting()
        self.abort_all()
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # the engine is still in use: leave the tiers as they are
            self._thread = None
        self.close_tiers()

    @property
    def tiers(self) -> TieredKV | None:
        """The KV tiers below the device prefix cache (None without them, or once closed)."""
        return self.prefix.tiers

    def close_tiers(self) -> None:
        """Persists the KV tiers (the scheduler must not be stepping): every block the device
        cache holds is demoted, host blocks are written to disk (a warm restart finds them), the
        writes are waited for and the disk directory is released. Idempotent."""
        self.prefix.close()

    def offload_prefix_cache(self) -> int:
        """Demotes every block of the device prefix cache to the KV tiers and empties the device cache;
        returns how many blocks moved. Call it between steps (not while the scheduler thread runs):
        running requests keep their pages, which are only no longer offered to others."""
        return self.prefix.offload()

    # ---- scheduler thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stop and not self._live:
                    return
            try:
                worked = self.step()
            except Exception as exc:  # an engine bug: fail everything, refuse new work
                log.exception("scheduler step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                worked = True
            if not worked:
                with self._lock:
                    if not self._inbox and not self._aborts and not self._stop:
                        # Wake up now and then for deadlines of waiting requests.
                        self._wake.wait(timeout=0.05)

    def step(self) -> bool:
        """One scheduling round; returns False when there was nothing to do."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        self._waiting.extend(inbox)
        for seq in inbox:  # read its disk blocks into host memory while it queues
            self.prefix.prefetch(seq.prompt, seq.images, seq.cache_scope)
        for seq in aborts:
            self._finish(seq, FinishReason.ABORT)  # a no-op if it finished meanwhile
        now = self.clock()
        self._expire(now)
        self._admit(now)
        self._yield_segments(now)
        worked = bool(inbox or aborts)
        # With overlap scheduling the previous step's decode is still in flight: take its tokens,
        # handle at once only what decides the next step's rows (below), dispatch the next decode,
        # and handle the rest of the tokens while the device runs it.
        later: list[tuple[_Seq, SampledToken]] = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            later = self._take_overlapped(*inflight)
            worked = True
        # Dispatch the decode first: the device runs it while the host plans and dispatches the
        # prefill (Engram hashing, padding, page tables); then the decode's tokens are handled while
        # the prefill runs, and the prefill's results last.
        decoding = self._decode_dispatch()
        overlap = (
            decoding is not None and decoding[2] is None and self.config.overlap_schedule and not self._dspark
        )
        if overlap:
            active, pending, _ = decoding
            tickets = [(int(s), self._slots[s], self._slots[s].admissions) for s in np.flatnonzero(active)]
            self._inflight = (active, pending, tickets)
        prefill = self._prefill_dispatch()
        for seq, tok in later:
            if not seq.done:
                self._handle_token(seq, tok)
        if decoding is not None and not overlap:
            self._decode_finish(*decoding)
        if prefill is not None:
            self._prefill_finish(*prefill)
        if decoding is None and prefill is None and self._outstanding == 0:
            self._results_at = None  # nothing ran: the wait for work is not idle time between steps
        worked = worked or decoding is not None or prefill is not None
        self._update_gauges()
        return worked

    def _dispatched(self, pending):
        """Counts an engine call in flight; the first one after the host took every result starts a
        busy period, and the gap since that last result is the device's idle time (a lower bound:
        the device may have finished before the host asked for the result)."""
        if self._outstanding == 0:
            self._dispatched_at = time.perf_counter()
            self._idle_before = None if self._results_at is None else self._dispatched_at - self._results_at
        self._outstanding += 1
        return pending

    def _result(self, pending):
        result = pending.result()
        self._outstanding -= 1
        if self._outstanding == 0:
            self._results_at = time.perf_counter()
            if self.metrics is not None:
                self.metrics.observe_step(self._idle_before, self._results_at - self._dispatched_at)
        return result

    def _take_overlapped(self, active, pending, tickets) -> list[tuple[_Seq, SampledToken]]:
        """Takes an overlapped decode step's tokens. Rows whose request left its slot meanwhile (a
        stop string, an abort, a deadline, a yield) are dropped. A token that decides whether its
        request takes part in the next step (a stop token, the last of max_tokens, a grammar's next
        mask) is handled now; the others are only recorded (`_take_token`, so the next step has its
        inputs) and returned, to be handled once the next step is dispatched."""
        result = self._result(pending)
        later, rows = [], 0
        for slot, seq, admissions in tickets:
            if self._slots[slot] is not seq or seq.done or not seq.decoding or seq.admissions != admissions:
                self.overlap_dropped_rows += 1
                if self.metrics is not None:
                    self.metrics.overlap_dropped_rows.inc()
                continue
            rows += 1
            tok = result.row(slot)
            last = seq.generated + 1 >= seq.max_tokens
            if self._stops(seq, tok.token_id) or last or seq.matcher is not None:
                self._on_token(seq, tok)
            else:
                self._take_token(seq, tok)
                later.append((seq, tok))
        if self.metrics is not None and rows:
            self.metrics.observe_decode_step([1] * rows)
        return later

    def _expire(self, now: float) -> None:
        expired = [s for s in self._waiting if s.req.deadline is not None and s.req.deadline <= now]
        expired += [
            s for s in self._slots if s is not None and s.req.deadline is not None and s.req.deadline <= now
        ]
        for seq in expired:
            seq.deadline_exceeded = True
            self._finish(seq, FinishReason.ABORT)

    def _admit(self, now: float) -> None:
        ps = self.spec.page_size
        limit = self.config.running_limit
        while self._waiting and self._free_slots and self.num_running < limit:
            seq = self._waiting[0]
            n = len(seq.prompt)
            block = self._pick_block(seq)
            entries, chain = self.prefix.match(seq.prompt, seq.images, seq.cache_scope, block)
            hit_pages = [e.page for e in entries]
            left = seq.max_tokens - seq.generated
            total = reserved_pages(n, left, self._dspark, ps, self.spec.pages_per_slot)
            self.pool.acquire(hit_pages)
            need = total - len(hit_pages)
            available = self.pool.num_available if block is None else self.pool.num_available_in(block)
            if available < need:
                self.pool.release(hit_pages)
                break  # strict FIFO: the head waits for pages rather than being overtaken
            seq.pages = hit_pages + self.pool.allocate(need, block)
            self.prefix.demote_evicted()  # their pages are rewritten by this step's prefill: read them first
            restored = self.prefix.restore(chain, seq.pages[len(hit_pages) :])
            self._waiting.popleft()
            slot = self._free_slots.take(block)
            seq.slot = slot
            self._slots[slot] = seq
            self.page_tables[slot] = 0
            self.page_tables[slot, : len(seq.pages)] = seq.pages
            cached = (len(entries) + len(restored)) * ps
            seq.write_from = cached
            seq.prefilled = seq.window_floor = max(0, cached - self.spec.replay_tokens)
            seq.registered = len(entries) + len(restored)
            seq.segment_from = seq.generated
            seq.admissions += 1
            seq.parent_key = restored[-1] if restored else entries[-1].key if entries else ROOT_KEY
            sp, rows = seq.req.sampling, self._sampling
            rows.temperature[slot], rows.top_p[slot] = sp.temperature, sp.top_p
            rows.top_k[slot], rows.seed[slot] = sp.top_k, sp.seed
            self._fill_mask(seq)  # the first token's
            self._prefilling.append(seq)
            if seq.admissions > 1:  # a yielded request back for its next segment
                continue
            seq.cached_tokens = seq.write_from
            mode = seq.req.prefill_mode or self.config.prefill_mode
            seq.decoder_from = max(0, n - self.spec.ced_window) if mode == "ced" else 0
            if self.metrics is not None:
                self.metrics.queue_time.observe(now - seq.arrival)
                self.metrics.observe_prefix(seq.cached_tokens, n)
                self.metrics.prompt_tokens.inc(n)

    def _pick_block(self, seq: _Seq) -> int | None:
        """Under data-parallel attention (`EngineSpec.kv_blocks` > 1) the device block the request
        runs on (`FreeSlots.pick_block`); None with one block."""
        if self.spec.kv_blocks == 1:
            return None
        entries = self.prefix.device_match(seq.prompt, seq.images, seq.cache_scope)
        prefix_block = self.pool.block_of(entries[0].page) if entries else None
        return self._free_slots.pick_block(prefix_block, self.pool.num_available_in)

    def _yield_segments(self, now: float) -> None:
        """Flow control (module docstring, 2): while requests wait that admission could not place,
        decoding requests past their segment yield their slots, most generated first, each followed
        by an admission round; stops once only requests that yielded here are waiting."""
        segment = self.config.decode_segment_tokens
        if not segment or not self._waiting:
            return
        running = [s for s in self._slots if s is not None and s.decoding]
        yielded: list[_Seq] = []
        for seq in yield_order(running, segment):
            if all(w in yielded for w in self._waiting):
                return
            self._yield_slot(seq)
            yielded.append(seq)
            self._admit(now)

    def _yield_slot(self, seq: _Seq) -> None:
        """Registers the request's full blocks of prompt + output (the last sampled token's KV is not
        written yet), releases its slot and pages, and queues it with prompt + output as its prompt."""
        ids = self._register_context(seq)
        self._release(seq)
        seq.prompt = ids
        seq.prefilled = seq.registered = 0
        seq.parent_key = ROOT_KEY
        seq.window_floor = seq.write_from = 0
        self._waiting.append(seq)
        if self.metrics is not None:
            self.metrics.segment_yields.inc()

    def _register_context(self, seq: _Seq) -> np.ndarray:
        """Registers the full blocks of a decoding request's prompt + output in the prefix cache
        (positions before its last sampled token hold KV), so a later request continuing the
        conversation, or the request itself after a yield, reuses them; returns prompt + output."""
        ids = np.concatenate([seq.prompt[: seq.prompt_len], np.asarray(seq.output_ids, np.int32)])
        self._register_blocks(seq, ids, seq.pos // self.spec.page_size)
        return ids

    def _register_blocks(self, seq: _Seq, ids: np.ndarray, end_block: int) -> None:
        """Registers the request's full blocks of `ids` it has not registered yet, up to `end_block`."""
        blocks = range(seq.registered, end_block)
        seq.parent_key = self.prefix.register(
            seq.parent_key, ids, seq.pages, blocks, seq.cache_scope, seq.images
        )
        if blocks:
            seq.registered = end_block

    def _prefill_dispatch(self):
        """Plans and dispatches this step's prefill; None when no request is prefilling."""
        decoding = any(s is not None and s.decoding for s in self._slots)
        rows, budget = max(self.config.prefill_rows), self.config.prefill_token_budget
        plan = plan_prefill(self._prefilling, decoding, self.spec, rows, budget)
        if not plan:
            return None
        self._fill_masks()
        chunks = [self._chunk(seq, end) for seq, end in plan]
        return plan, self._dispatched(self.engine.prefill_async(chunks))

    def _chunk(self, seq: _Seq, end: int) -> PrefillChunk:
        spec = self.spec
        n = len(seq.prompt)
        start = seq.prefilled
        decoder_from = seq.decoder_from
        h = spec.history_tokens
        types, span_embeds = chunk_images(seq.images, start, end, spec.hidden_size)
        history_types, _ = chunk_images(seq.images, max(0, start - h), start, spec.hidden_size)
        return PrefillChunk(
            slot=seq.slot,
            token_ids=seq.prompt[start:end],
            start_pos=start,
            page_table=self.page_tables[seq.slot].copy(),
            history=seq.prompt[max(0, start - h) : start] if h else seq.prompt[:0],
            sampling=seq.req.sampling,
            is_last_chunk=end == n,
            history_types=history_types,
            window_floor=seq.window_floor,
            write_from=seq.write_from,
            token_bitmask=self._bitmask[seq.slot].copy() if end == n and seq.matcher is not None else None,
            token_types=types,
            span_embeds=span_embeds,
            decoder_from=decoder_from,
        )

    def _prefill_finish(self, plan, pending) -> None:
        for (seq, end), result in zip(plan, self._result(pending), strict=True):
            self._prefilled(seq, end, result)

    def _prefilled(self, seq: _Seq, end: int, result) -> None:
        n = len(seq.prompt)
        seq.prefilled = end
        self._register_blocks(seq, seq.prompt, end // self.spec.page_size)
        if end == n:
            self._prefilling.remove(seq)
            self._drafts.forget(seq.slot)  # no drafts before the first speculative step
            seq.decoding = True
            seq.pos = n - 1  # so that the first token lands at n
            self._on_token(seq, result.token)

    def _decode_dispatch(self):
        """Dispatches a decode step over every slot whose prefill is done; None when there is none.
        Returns (active, pending, n_drafts: None for a plain step)."""
        active = np.array([s is not None and s.decoding for s in self._slots])
        if not active.any():
            return None
        if self._dspark:
            ps = self.spec.page_size
            rows = [
                (slot, seq.max_tokens - seq.generated, len(seq.pages) * ps - 1 - seq.pos)
                for slot in np.flatnonzero(active)
                for seq in (self._slots[slot],)
            ]
            width, n_drafts = self._drafts.plan(rows)
            if width:
                return self._speculative_dispatch(active, width, n_drafts)
        self._fill_masks()
        batch = DecodeBatch(
            active=active,
            token_ids=self._tokens.copy(),
            positions=self._positions.copy(),
            page_tables=self.page_tables.copy(),
            sampling=self._sampling_rows(self._bitmask.copy()),
        )
        return active, self._dispatched(self.engine.decode_async(batch)), None

    def _sampling_rows(self, token_bitmask: np.ndarray | None) -> SamplingBatch:
        """A copy of every slot's sampling parameters, with this step's token masks."""
        rows = self._sampling
        return SamplingBatch(
            rows.temperature.copy(), rows.top_p.copy(), rows.top_k.copy(), rows.seed.copy(), token_bitmask
        )

    def _speculative_dispatch(self, active: np.ndarray, width: int, n_drafts: np.ndarray):
        """A decode step that verifies each row's `n_drafts` drafts (cut where its grammar forbids
        one) over a [S, width] draft block. Its drafts and tokens are the previous step's results,
        so it is only built once that step is back on the host (`step` finishes a decode before the
        next dispatch); a speculative step can never be dispatched ahead of its predecessor."""
        S, W = self.spec.max_slots, mask_words(self.spec.vocab_size)
        drafts = self._drafts.block(width)
        # Decoding rows get their masks here (with the drafts'); the [S, W] rows are for prefill.
        self._masks_due = [s for s in self._masks_due if not s.decoding]
        bitmask = None
        for slot in np.flatnonzero(active):
            seq = self._slots[slot]
            if seq.matcher is None:
                continue
            if bitmask is None:
                bitmask = np.full((S, width + 1, W), -1, np.int32)
            k = int(n_drafts[slot])
            n_drafts[slot] = seq.matcher.fill_draft_masks(drafts[slot, :k], bitmask[slot, : k + 1])
        batch = DecodeBatch(
            active=active,
            token_ids=self._tokens.copy(),
            positions=self._positions.copy(),
            page_tables=self.page_tables.copy(),
            sampling=self._sampling_rows(bitmask),
            drafts=DraftInputs(drafts, np.where(active, n_drafts, 0).astype(np.int32)),
        )
        return active, self._dispatched(self.engine.decode_async(batch)), batch.drafts.n_drafts

    def _decode_finish(self, active: np.ndarray, pending, n_drafts: np.ndarray | None = None) -> None:
        result = self._result(pending)
        slots = np.flatnonzero(active)
        if result.emitted is None:
            for slot in slots:
                self._on_token(self._slots[slot], result.row(int(slot)))
            self._drafts.forget(slots)  # a plain step drafts nothing
            if self.metrics is not None:
                self.metrics.observe_decode_step([1] * len(slots))
            return
        emitted = [int(result.emitted[slot]) for slot in slots]
        for slot, e in zip(slots, emitted, strict=True):
            check_emitted(slot, e, int(n_drafts[slot]))
            seq = self._slots[slot]
            seq.accepted_drafts += e - 1
            for tok in result.tokens(int(slot)):
                self._on_token(seq, tok)
                if seq.done:  # finished mid-block: the tokens after it are dropped
                    break
            else:
                self._drafts.keep(slot, result.next_drafts[slot], result.next_confidence[slot])
        if self.metrics is not None:
            self.metrics.observe_decode_step(emitted, [int(n_drafts[slot]) for slot in slots])

    def _on_token(self, seq: _Seq, tok: SampledToken) -> None:
        self._take_token(seq, tok)
        self._handle_token(seq, tok)

    def _take_token(self, seq: _Seq, tok: SampledToken) -> None:
        """Records a sampled token: the request's counts and times, and its slot's next inputs."""
        now = self.clock()
        seq.generated += 1
        seq.output_ids.append(tok.token_id)
        seq.pos += 1
        seq.last_token = tok.token_id
        self._tokens[seq.slot] = tok.token_id
        self._positions[seq.slot] = seq.pos
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.metrics is not None:
                self.metrics.ttft.observe(now - seq.arrival)
        seq.last_token_time = now
        if self.metrics is not None:
            self.metrics.generation_tokens.inc()

    def _handle_token(self, seq: _Seq, tok: SampledToken) -> None:
        """A recorded token's effects: the grammar, stop tokens and strings, max_tokens, the text and
        log-probabilities sent to the client."""
        req = seq.req
        m = seq.matcher
        if m is not None:
            m.consume(tok.token_id)
            if m.error is not None:
                self._finish(
                    seq,
                    FinishReason.ABORT,
                    error=f"constraint: the grammar failed at token {tok.token_id}: {m.error}",
                    error_field="constraint",
                )
                return
        if self._stops(seq, tok.token_id):
            self._finish(seq, FinishReason.STOP)
            return
        payload = None
        if req.logprobs:
            top = tuple(
                (int(i), float(lp))
                for i, lp in zip(tok.top_ids[: req.logprobs], tok.top_logprobs[: req.logprobs], strict=True)
            )
            payload = TokenLogprobs(tok.token_id, tok.logprob, top)
        rel = seq.text.push(tok.token_id, payload)
        if rel.stopped or (m is not None and m.done):  # a stop string, or the grammar is complete
            self._finish(seq, FinishReason.STOP, rel)
        elif seq.generated >= seq.max_tokens:
            self._finish(seq, FinishReason.LENGTH, rel)
        else:
            if rel.token_ids or rel.text:
                self._emit(seq, rel)
            self._fill_mask(seq)  # the next token's, before the next engine call

    def _stops(self, seq: _Seq, token_id: int) -> bool:
        """Whether a sampled token is a stop token of its request (its stop ids, or EOS unless ignored)."""
        return token_id in seq.req.stop_token_ids or (token_id in self._eos and not seq.req.ignore_eos)

    def _fill_mask(self, seq: _Seq) -> None:
        """Makes the slot's row the mask of the request's next token before the next engine call:
        all ones without a constraint, else due for `_fill_masks`."""
        if seq.matcher is None:
            self._bitmask[seq.slot] = -1
        else:
            self._masks_due.append(seq)

    def _fill_masks(self) -> None:
        """Fills the rows of every request due (one batched call), skipping those that finished."""
        due = [(s.matcher, s.slot) for s in self._masks_due if not s.done and s.slot is not None]
        self._masks_due = []
        if due:
            self._constraint_tokenizer.fill_masks(due, self._bitmask)

    def _emit(
        self, seq: _Seq, rel: Released | None, reason=None, usage=None, error=None, error_field=None
    ) -> None:
        ev = StreamEvent(
            request_id=seq.req.request_id,
            token_ids=tuple(rel.token_ids) if rel else (),
            text=rel.text if rel else "",
            logprobs=tuple(p for p in rel.payloads if p is not None) if rel else (),
            finish_reason=reason,
            usage=usage,
            error=error,
            error_field=error_field,
            deadline_exceeded=reason is FinishReason.ABORT and seq.deadline_exceeded,
        )
        try:
            seq.sink(ev)
        except Exception:  # a broken sink must not take the scheduler down
            log.exception("event sink failed for %s", seq.req.request_id)

    def _finish(
        self, seq: _Seq, reason: FinishReason, rel: Released | None = None, error=None, error_field=None
    ) -> None:
        if seq.done:
            return
        seq.done = True
        if seq.decoding and error is None and reason is not FinishReason.ABORT:
            self._register_context(seq)  # the next turn of a conversation starts with it
        self._release(seq)
        if reason is not FinishReason.ABORT and not (rel is not None and rel.stopped):
            tail = seq.text.finish()  # nothing more will come: flush held-back text
            if rel is None:
                rel = tail
            else:
                rel = Released(
                    rel.token_ids + tail.token_ids, rel.text + tail.text, rel.payloads + tail.payloads
                )
        usage = Usage(seq.prompt_len, seq.cached_tokens, seq.generated, seq.accepted_drafts)
        if error is None:
            self._emit(seq, rel, reason=reason, usage=usage)
        else:
            self._emit(seq, None, error=error, error_field=error_field)
        if self.metrics is not None:
            if error is None:
                self.metrics.requests_finished.labels(finish_reason=reason.value).inc()
            if seq.generated >= 2:
                tpot = (seq.last_token_time - seq.first_token_time) / (seq.generated - 1)
                self.metrics.tpot.observe(tpot)
        with self._lock:
            self._live.pop(seq.live_key, None)

    def _release(self, seq: _Seq) -> None:
        """Frees the slot and every page reference of `seq` (idempotent)."""
        if seq.slot is not None:
            slot = seq.slot
            self.engine.release(slot)
            self._slots[slot] = None
            self._free_slots.give_back(slot)
            self.page_tables[slot] = 0
            self._bitmask[slot] = -1
            self._drafts.forget(slot)
            seq.slot = None
            if seq in self._prefilling:
                self._prefilling.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if seq.pages:
            self.pool.release(seq.pages)
            seq.pages = []
        seq.decoding = False

    def _fail_all(self, error: str) -> None:
        self._inflight, self._outstanding = None, 0
        with self._lock:
            self._failed = error
            seqs = list(self._live.values())
            self._inbox = []
            self._aborts = []
        for seq in seqs:
            try:
                self._finish(seq, FinishReason.ABORT, error=error)
            except Exception:
                log.exception("cleanup after engine failure")
                with self._lock:
                    self._live.pop(seq.live_key, None)

    def _reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason=reason).inc()

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        m.queue_depth.set(len(self._waiting))
        m.active_slots.set(self.num_running)
        m.pages_used.set(self.pool.num_referenced)
        m.pages_free.set(self.pool.num_free)
        m.pages_cached.set(self.pool.num_cached)
        m.compiles_after_warmup.set(self.engine.compiles_after_warmup)
        self.prefix.export_gauges(m)
