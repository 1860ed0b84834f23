"""The serving engine: `JaxEngine` implements `serving.engine.protocol.EngineProtocol` over `ced_jax.engine`.

The device work is a `ced_jax.engine.Engine` (the one state, the model's `Programs`, the Engram history
per slot), the same engine the notebook API runs; this module adds what the scheduler's protocol needs
on top: slot bookkeeping and checks, decode batch buckets, prefix-hit replay, and warm-up.

Programs, compiled by `warmup()`, which runs each of them through the serving code path (a one-token
prefill and one decode step on slot 0, idle calls of the other prefill and decode batch sizes), so
that every later call finds its executable in jit's cache. The serving calls stay ordinary jit
calls, watched by a `CompileCounter` that counts JAX's own compilation events: a call whose
shapes, dtypes or shardings warm-up did not cover compiles, and shows in `compiles_after_warmup`
(and on /metrics):
- prefill: the chunks (up to `prefill_chunk` tokens each, the one bucket) of several slots, the
  engine's `prefill_batch` program over R rows, R the smallest of `prefill_rows` that holds them,
  padded with distinct other slots of length 0 (they write nothing): a `lax.while_loop` over the
  pages, `forward` on [R, page_size] per iteration, then each row's sample. The trip count is
  dynamic, so a batch costs the pages of its longest chunk. The default is one row count
  (`ServeConfig.prefill_rows`): a row's prefill arithmetic on XLA:CPU depends on the row count, so
  one count keeps prefix-cache hits bit-identical to cold runs whatever shares the batch.
- decode: one token for each row of a batch of the smallest `decode_buckets` size that holds the
  active slots (ServeConfig: 8, 16, 32 for 32 slots), padded with distinct idle slots of length 0
  (they write nothing), sampling inside (`ced_jax.sampling`), so only tokens and log-probabilities
  come back. Every row's sample is under its token mask (all ones when unconstrained), an argument
  of fixed shape [rows, ceil(vocab / 32)], so constraints never compile anything. A lone stream thus
  pays for 8 rows, not `max_slots`; why not 1, see
  `ServeConfig.decode_buckets`.
- speculative decode (`ServeConfig.dspark` K > 0, a model with DSpark stages): the engine's
  `speculative_decode` program for each draft width w (K alone; every 1..K with
  `dspark_confidence`, so a step whose rows all want fewer drafts runs a narrower one) and each
  decode batch size, rows bucketed like decode; its results come back already on the host. With
  K > 0 the engine is built with `with_draft=True`, so prefill and the plain decode step (used when a
  row is within K of max_context) also insert the DSpark context.
Every program above is compiled once per page-table width (`ServeConfig.decode_context_buckets`),
and a call's page tables are cut to the smallest width that holds its rows' last position: the
indexer scores every entry its table reaches, so tables of max_context would make every step cost
what a max_context-token one does. Entries past a row's length are invisible to it at any width, and
each indexer's top-k width is the same at every compiled width (checked at construction), so the
tokens and log-probabilities are the same bit for bit (tests/serving/test_serving_jax.py).
`prefill_async` and `decode_async` only dispatch their program (JAX runs it asynchronously); the
returned `Pending` copies the results to the host when asked, so the scheduler overlaps host work
with the device's.

Why a page per iteration: it makes prefix-cache hits exact by construction. Every page of a prompt
is computed by the same program from the same inputs (its tokens, position, the pages before it and
the slot state at its start), whether the request starts cold at 0 or replays from a page boundary
after a prefix hit, however the scheduler cut the prompt into chunks, and whichever other rows share
the call (with one `prefill_rows` size). (A whole-chunk forward would
sum attention terms in an order that depends on where the chunk starts.) The price is prefill
matmuls of page_size rows; pick page_size accordingly on an accelerator.

Prefix hits (`EngineSpec.replay_tokens`, `ced_jax.engine.replay_tokens`): the cache keeps only the
pages (compressed KV and index keys: `kv_bytes_per_token`, 890 B for v41-flash). A request that
shares the pages before b starts on a fresh slot at s = b - replay_tokens (or 0) with window_floor s
and write_from b: the program recomputes [s, b) to rebuild the SWA rings (and DSpark's context rings)
and writes no page before b; the Engram history at s comes from the chunk's `history` tokens (their
`history_types` mark image spans dead; only the replay's first positions read it, and those lie
outside b's receptive field). The compressor's partial group needs nothing: page_size is a
multiple of every ratio, so no group straddles b. tests/ced_jax/test_prefix_replay.py shows the
result bit-identical to a cold run.

On a device mesh (`ced_jax.load(..., mesh=...)`, `ced-jax serve --mesh`), see `ced_jax.engine`: the
state is laid out by the model's rules and every program pins that layout. On a mesh over several
processes (multi-host), this engine runs on process 0 and hands every program call to the others
(`serving.engine.multihost`).

A fresh slot needs no reset: at position 0 the ring is masked by position and the partial group is
not read, and pages past a sequence are never read unmasked (see `ced_jax.cache`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import NamedTuple

import jax
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax.engine import Engine, SamplingBatch, StateShapes, replay_tokens
from ced_jax.engine.page_io import PageLayout
from serving.config import ServeConfig
from serving.constraints import ConstraintTokenizer
from serving.engine.protocol import (
    CompileCounter,
    DecodeBatch,
    DecodeResult,
    EngineSpec,
    PrefillChunk,
    PrefillResult,
    Ready,
    SampledToken,
    SamplingParams,
    mask_words,
)


class WarmupEntry(NamedTuple):
    """One program call of `JaxEngine.warmup`: executables compiled and loaded from the persistent
    cache, the seconds JAX spent building them, and the call's wall time."""

    program: str
    compiled: int
    from_cache: int
    compile_seconds: float
    load_seconds: float
    seconds: float


def _rows_of(sampling: SamplingBatch, rows: np.ndarray) -> SamplingBatch:
    """The sampling inputs of a step's rows (slots `rows`; a None mask stays None: all ones)."""
    mask = sampling.token_bitmask
    return SamplingBatch(
        np.asarray(sampling.temperature, np.float32)[rows], np.asarray(sampling.top_p, np.float32)[rows],
        np.asarray(sampling.top_k, np.int32)[rows], np.asarray(sampling.seed, np.uint32)[rows],
        None if mask is None else np.asarray(mask, np.int32)[rows],
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _PrefillRows:
    """The host inputs of one `prefill_batch` program call: the chunks' rows, then idle rows."""

    slots: np.ndarray  # i32 [R]
    tokens: np.ndarray  # i32 [R, prefill_chunk]
    n: np.ndarray  # i32 [R]; 0 on idle rows
    start: np.ndarray  # i32 [R]
    page_tables: np.ndarray  # i32 [R, pages_per_slot]
    sampling: SamplingBatch  # [R] each; token_bitmask i32 [R, W], all ones = unconstrained
    decoder_from: np.ndarray  # i32 [R]; CED prefill's decoder start, 0 = exact
    window_floor: np.ndarray  # i32 [R]; a prefix hit's replay start, else 0
    write_from: np.ndarray  # i32 [R]; the end of the shared cached pages, else 0
    # Image spans (both or neither): set when a chunk of the batch has one, so text-only batches run
    # the text program; text rows of an image batch are all -1 with zero rows.
    token_types: np.ndarray | None = None  # i32 [R, prefill_chunk]
    span_embeds: np.ndarray | None = None  # f32 [R, prefill_chunk, D]

    def with_images(self, engine: JaxEngine) -> _PrefillRows:
        """These rows with all-text image inputs (to be filled per chunk)."""
        size, width = self.tokens.shape
        return dataclasses.replace(
            self,
            token_types=np.full((size, width), -1, np.int32),
            span_embeds=np.zeros((size, width, engine.cfg.hidden_size), np.float32),
        )

    @classmethod
    def idle(
        cls,
        size: int,
        engine: JaxEngine,
        slots: np.ndarray | None = None,
        pages: int | None = None,
        width: int | None = None,
    ) -> _PrefillRows:
        """`size` rows that bring nothing (slots 0.., or `slots`), page tables of `pages` pages (None:
        pages_per_slot), chunks of `width` tokens (None: the prefill chunk)."""
        return cls(
            slots=np.arange(size, dtype=np.int32) if slots is None else np.asarray(slots, np.int32),
            tokens=np.full((size, width or engine.prefill_chunk), engine.cfg.pad_token_id, np.int32),
            n=np.zeros(size, np.int32),
            start=np.zeros(size, np.int32),
            page_tables=np.zeros((size, pages or engine.spec.pages_per_slot), np.int32),
            sampling=SamplingBatch.broadcast(
                size, token_bitmask=np.full((size, mask_words(engine.cfg.vocab_size)), -1, np.int32)
            ),
            decoder_from=np.zeros(size, np.int32),
            window_floor=np.zeros(size, np.int32),
            write_from=np.zeros(size, np.int32),
        )

    @classmethod
    def build(
        cls, chunks: Sequence[PrefillChunk], size: int, engine: JaxEngine, width: int | None = None
    ) -> _PrefillRows:
        """The chunks' rows in a batch of `size` (chunks of `width` tokens, None: the prefill chunk),
        the rest idle rows on distinct other slots. Under data-parallel attention row block d holds the
        chunks of block d's slots, then idle slots of block d."""
        blocks, max_slots = engine.kv_blocks, engine.spec.max_slots
        per_slot, per_row = max_slots // blocks, size // blocks
        used = {c.slot for c in chunks}
        row_of: dict[int, int] = {}
        slots = []
        for d in range(blocks):
            mine = [i for i, c in enumerate(chunks) if c.slot // per_slot == d]
            others = [s for s in range(d * per_slot, (d + 1) * per_slot) if s not in used]
            for i in mine:
                row_of[i] = len(slots)
                slots.append(chunks[i].slot)
            slots.extend(others[: per_row - len(mine)])
        rows = cls.idle(size, engine, slots, width=width)
        if any(c.token_types is not None for c in chunks):
            rows = rows.with_images(engine)
        for i, c in enumerate(chunks):
            r = row_of[i]
            rows.tokens[r, : len(c.token_ids)] = c.token_ids
            rows.n[r] = len(c.token_ids)
            rows.start[r] = c.start_pos
            rows.decoder_from[r] = c.decoder_from
            rows.window_floor[r], rows.write_from[r] = c.window_floor, c.write_from
            rows.page_tables[r] = c.page_table
            sp, sampling = c.sampling, rows.sampling
            sampling.temperature[r], sampling.top_p[r] = sp.temperature, sp.top_p
            sampling.top_k[r], sampling.seed[r] = sp.top_k, sp.seed
            if c.token_bitmask is not None:
                sampling.token_bitmask[r] = c.token_bitmask
            if c.token_types is not None:
                rows.token_types[r, : len(c.token_ids)] = c.token_types
                rows.span_embeds[r, : len(c.token_ids)] = c.span_embeds
        return rows


class _PendingDecode:
    """A dispatched decode step: `result()` copies the drawn tokens to the host (once) and puts
    them back in their slots' rows (idle rows are garbage)."""

    def __init__(self, out, slots: np.ndarray, max_slots: int):
        self._out, self._slots, self._max_slots = out, slots, max_slots
        self._result: DecodeResult | None = None

    def result(self) -> DecodeResult:
        if self._result is None:
            out = jax.device_get(self._out)
            full = [np.zeros((self._max_slots, *a.shape[1:]), a.dtype) for a in out]
            for dst, src in zip(full, out, strict=True):
                dst[self._slots] = src
            tok, lp, ids, tlp = full
            self._result = DecodeResult(token_ids=tok, logprobs=lp, top_ids=ids, top_logprobs=tlp)
            self._out = None
        return self._result


class _PendingPrefill:
    """A dispatched prefill batch: `result()` copies the first token of last chunks to the host and
    makes the chunks' `PrefillResult`s (once)."""

    def __init__(self, chunks: list[PrefillChunk], out, row_of: list[int]):
        self._chunks, self._out, self._row_of = chunks, out, row_of
        self._results: list[PrefillResult] | None = None

    def result(self) -> list[PrefillResult]:
        if self._results is not None:
            return self._results
        out = jax.device_get(self._out) if any(c.is_last_chunk for c in self._chunks) else None
        results = []
        for r, chunk in enumerate(self._chunks):
            token = None
            if chunk.is_last_chunk:
                tok, lp, ids, tlp = (a[self._row_of[r]] for a in out)
                token = SampledToken(token_id=int(tok), logprob=float(lp), top_ids=ids, top_logprobs=tlp)
            results.append(PrefillResult(token=token))
        self._results = results
        self._out = None
        return results


def _dspark_widths(model, config: ServeConfig) -> tuple[int, ...]:
    """The draft widths to compile for `config.dspark` K (none for 0; every 1..K with a confidence
    threshold, else K alone); ValueError naming the flag if the model cannot draft K tokens."""
    k, cfg = config.dspark, model.cfg
    if not k:
        return ()
    if not cfg.num_nextn_predict_layers or not cfg.dspark_block_size or "mtp" not in model.params:
        raise ValueError(
            f"dspark (--dspark) {k}: the model {cfg.name!r} has no DSpark draft stages "
            "(a checkpoint with mtp.* tensors and dspark_block_size); serve it with --dspark 0"
        )
    limit = min(cfg.dspark_block_size, cfg.sliding_window - 1)
    if k > limit:
        raise ValueError(
            f"dspark (--dspark) {k}: at most the model's draft block size {cfg.dspark_block_size} "
            f"(and sliding_window - 1 = {cfg.sliding_window - 1})"
        )
    return tuple(range(1, k + 1)) if config.dspark_confidence is not None else (k,)


def _page_buckets(pages_per_slot: int) -> tuple[int, ...]:
    """Page counts the page-copy programs are compiled for: powers of two up to a request's pages."""
    out, n = [], 1
    while n < pages_per_slot:
        out.append(n)
        n *= 2
    return (*out, pages_per_slot)


def _context_pages(cfg, config: ServeConfig) -> tuple[int, ...]:
    """`config.decode_context_buckets` in pages, checked against the model: at every width each
    indexer's top-k width (min(index_topk, entries)) is the one of max_context, so a narrower table
    selects the same entries into the same shapes."""
    page_size, full = config.page_size, config.max_context
    ratios = {cfg.compress_ratios[i] for i in cfg.index_source_layer_ids if cfg.compress_ratios[i] > 0}
    for tokens in config.decode_context_buckets:
        for r in sorted(ratios):
            if min(cfg.index_topk, tokens // r) != min(cfg.index_topk, full // r):
                raise ValueError(
                    f"decode_context_buckets: {tokens} tokens hold {tokens // r} entries of compress "
                    f"ratio {r}, fewer than the indexer's top-k {cfg.index_topk}: the smallest width "
                    f"must be at least {cfg.index_topk * max(ratios)} tokens (or max_context)"
                )
    return tuple(t // page_size for t in config.decode_context_buckets)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), n)


def weights_id(model) -> bytes:
    """What tells checkpoints of one config apart in a KV fingerprint: every weight byte
    (`Model.weights_digest`: the checkpoint's files, hashed once and cached by size and mtime, or the
    arrays of an in-memory model). Pages written under other weights are refused by the disk tier."""
    return model.weights_digest()


class ModelTokenizer:
    """`serving.text.Tokenizer` over a `ced_jax.api.Model`: encode prepends BOS, as `Model.encode`."""

    def __init__(self, model):
        self._model = model

    @property
    def tokenizer_file(self):
        """The model's tokenizer.json (None without one): the HTTP API renders and decodes with it."""
        return self._model.tokenizer_path

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._model.decode_text(list(token_ids))

    def constraint_tokenizer(self) -> ConstraintTokenizer | None:
        """llguidance's view of the model's tokenizer.json, for constrained decoding (the scheduler
        builds it once); None when the model has no tokenizer.json."""
        path = self._model.tokenizer_path
        if path is None:
            return None
        cfg = self._model.cfg
        return ConstraintTokenizer(path, vocab_size=cfg.vocab_size, eos_token_ids=(cfg.eos_token_id,))


class JaxEngine:
    """`serving.engine.protocol.EngineProtocol` over a `ced_jax.api.Model` (see the module docstring)."""

    def __init__(self, model, config: ServeConfig, *, cluster=None):
        """Built with `config`'s shapes (max_slots, page_size, num_pages, max_context, its one prefill
        bucket: the chunk length) and max_logprobs; the rest of `config` is the server's.
        cluster: the leader's `serving.engine.multihost.Cluster` of a multi-host run: every program run
        is handed to the other processes first (`multihost.Mirror`)."""
        if len(config.prefill_buckets) != 1:
            raise ValueError(
                "prefill_buckets: JaxEngine runs one prefill chunk length, got "
                f"{list(config.prefill_buckets)}"
            )
        cfg = model.cfg
        max_slots, page_size, max_context = config.max_slots, config.page_size, config.max_context
        num_pages, max_logprobs = config.num_pages, config.max_logprobs
        (prefill_chunk,) = config.prefill_buckets
        self.model = model
        self.cfg = cfg
        self.hasher = model.hasher
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        # Long prompts (ServeConfig.long_prefill_chunk): one text chunk at a time, kv_blocks rows (one
        # busy), `long_prefill_step` tokens per forward; 0 = no such program.
        self.long_prefill_chunk = config.long_prefill_chunk
        self.long_prefill_step = config.long_prefill_step
        self.decode_buckets = tuple(config.decode_buckets)
        self.prefill_rows = tuple(config.prefill_rows)
        self.max_logprobs = max_logprobs
        self.dspark_widths = _dspark_widths(model, config)
        self.context_pages = _context_pages(cfg, config)
        # Steps per page-table width (pages), for tests and benchmarks.
        self.decode_widths_used: collections.Counter[int] = collections.Counter()
        self.prefill_widths_used: collections.Counter[int] = collections.Counter()
        self.long_prefill_calls = 0  # calls of the long-prompt program, for tests and benchmarks
        # Prefill chunks per device block (data-parallel attention; block 0 otherwise).
        self.blocks_used: collections.Counter[int] = collections.Counter()
        self.engine = Engine(
            model.loaded,
            StateShapes(
                max_slots=max_slots, page_size=page_size, num_pages=num_pages, max_context=max_context
            ),
            with_draft=bool(self.dspark_widths),
        )
        # Data-parallel attention (`dp_ep`): slots, pages and every step's rows form one equal block
        # per device; a row runs in its slot's block (`_place_rows`, `_PrefillRows.build`).
        self.kv_blocks = self.engine.attention_shards
        for name, sizes in (("decode_buckets", self.decode_buckets), ("prefill_rows", self.prefill_rows)):
            if any(n % self.kv_blocks for n in sizes):
                raise ValueError(
                    f"{name} {list(sizes)}: under data-parallel attention every size must be a multiple "
                    f"of the {self.kv_blocks} devices (each runs an equal block of rows)"
                )
        if cluster is not None:
            from serving.engine.multihost import Mirror

            self.engine.mirror = Mirror(cluster)
        kv_bytes = cache_lib.kv_bytes_per_token(self.engine.state)
        # KV tiers: whole pages in and out of the state (not across processes: a multi-host leader
        # would have to hand the calls to the others).
        self.page_layout = PageLayout.for_config(cfg, page_size)
        self._kv_fingerprint: bytes | None = None
        self.page_layout.check_state(self.engine.state)
        tiers = cluster is None
        self._page_buckets = _page_buckets(max_context // page_size) if config.kv_tiers and tiers else ()
        self._spec = EngineSpec(
            max_slots=max_slots,
            page_size=page_size,
            num_pages=num_pages,
            max_context=max_context,
            prefill_buckets=(prefill_chunk,),
            vocab_size=cfg.vocab_size,
            eos_token_ids=(cfg.eos_token_id,),
            max_logprobs=max_logprobs,
            replay_tokens=replay_tokens(cfg, page_size, with_draft=bool(self.dspark_widths)),
            history_tokens=0 if self.hasher is None else self.hasher.max_ngram_size - 1,
            model_name=cfg.name,
            hidden_size=cfg.hidden_size if getattr(model, "vision", None) is not None else 0,
            image_token_id=cfg.image_token_id,
            dspark_widths=self.dspark_widths,
            dspark_max_drafts=cfg.dspark_block_size if self.dspark_widths else 0,
            ced_window=cfg.sliding_window if cfg.ced_boundary_or_none is not None else 0,
            kv_page_bytes=self.page_layout.page_bytes if tiers else 0,
            kv_blocks=self.kv_blocks,
            long_prefill_chunk=self.long_prefill_chunk,
            config_summary={
                "layers": str(cfg.num_layers),
                "hidden_size": str(cfg.hidden_size),
                "heads": str(cfg.num_heads),
                "head_dim": str(cfg.head_dim),
                "sliding_window": str(cfg.sliding_window),
                "compress_ratios": ",".join(map(str, cfg.compress_ratios[: cfg.num_layers])),
                "kv_bytes_per_token": f"{kv_bytes:g}",
            },
        )
        self.kv_bytes_per_token = kv_bytes
        self._pos = np.full(max_slots, -1, np.int64)  # next position to write; -1 = free
        self._decoding = np.zeros(max_slots, bool)
        self._counter = CompileCounter()
        self._warm = False
        self.warmup_report: list[WarmupEntry] = []  # what warmup() built, one entry per program call

    # ---- EngineProtocol -------------------------------------------------------------------------

    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def compiles_after_warmup(self) -> int:
        return self._counter.count

    def warmup(self) -> None:
        if self._warm:
            return
        self._warm = True
        self.warmup_report = []
        try:
            self._warm_up_programs()
        except BaseException:
            self._warm = False
            raise
        # Warm-up's own compiles and steps are not "after warm-up".
        self._counter.reset()
        self.decode_widths_used.clear()
        self.prefill_widths_used.clear()
        self.long_prefill_calls = 0
        self.blocks_used.clear()

    @contextmanager
    def _warm_step(self, program: str):
        """Records one warm-up call: what it built, fresh or from the persistent cache, and how long."""
        c = self._counter
        count, loaded, compile_s, load_s = c.count, c.loaded, c.compile_seconds, c.load_seconds
        start = time.perf_counter()
        yield
        from_cache = c.loaded - loaded
        self.warmup_report.append(
            WarmupEntry(
                program, c.count - count - from_cache, from_cache, c.compile_seconds - compile_s,
                c.load_seconds - load_s, time.perf_counter() - start,
            )
        )  # fmt: skip

    def _warm_up_programs(self) -> None:
        """Compiles every program by calling it as serving does, with the same argument types.

        A one-token prefill into slot 0 (page 0) and one decode step, then the slot is released. What
        they write is harmless: a fresh slot needs no reset and a page's entries are always written
        before they are read (module docstring)."""
        spec = self._spec
        table = np.zeros(spec.pages_per_slot, np.int32)
        greedy = SamplingParams(temperature=0.0)
        first_pages, first_rows = self.context_pages[0], self.prefill_rows[0]
        with self._warm_step(f"prefill rows={first_rows} pages={first_pages}"):
            first = self.prefill(
                PrefillChunk(
                    token_ids=np.array([self.cfg.bos_token_id], np.int32), start_pos=0, slot=0,
                    page_table=table, history=np.zeros(0, np.int32), sampling=greedy, is_last_chunk=True,
                )
            )  # fmt: skip
        S = spec.max_slots
        active = np.zeros(S, bool)
        active[0] = True
        tokens = np.full(S, self.cfg.pad_token_id, np.int32)
        tokens[0] = first.token.token_id
        positions = np.zeros(S, np.int32)
        positions[0] = 1
        with self._warm_step(f"decode rows={self.decode_buckets[0]} pages={first_pages}"):
            self.decode(
                DecodeBatch(
                    token_ids=tokens, positions=positions, active=active,
                    page_tables=np.zeros((S, spec.pages_per_slot), np.int32),
                    sampling=SamplingBatch.broadcast(S),
                )
            )  # fmt: skip
        self.release(0)
        for pages in self.context_pages:  # the step above compiled (smallest width, smallest size)
            for size in self.decode_buckets:
                if (pages, size) != (first_pages, self.decode_buckets[0]):
                    with self._warm_step(f"decode rows={size} pages={pages}"):
                        self._decode_idle_rows(size, pages)
        for width in self.dspark_widths:  # every draft width, batch size and table width, idle rows
            for size in self.decode_buckets:
                for pages in self.context_pages:
                    with self._warm_step(f"speculative width={width} rows={size} pages={pages}"):
                        self._speculative_idle_rows(size, width, pages)
        for pages in self.context_pages:  # likewise every row count and table width
            for size in self.prefill_rows:
                if (pages, size) != (first_pages, first_rows):
                    with self._warm_step(f"prefill rows={size} pages={pages}"):
                        self._prefill_rows(_PrefillRows.idle(size, self, pages=pages))
                if self._spec.hidden_size:  # the image variant (idle rows)
                    with self._warm_step(f"prefill+images rows={size} pages={pages}"):
                        self._prefill_rows(_PrefillRows.idle(size, self, pages=pages).with_images(self))
            if self.long_prefill_chunk:  # the long-prompt program (text only)
                with self._warm_step(f"long prefill rows={self.kv_blocks} pages={pages}"):
                    idle = _PrefillRows.idle(self.kv_blocks, self, pages=pages, width=self.long_prefill_chunk)
                    self._prefill_rows(idle, long=True)
        for n in self._page_buckets:  # KV tiers: every page-copy size (writes of dropped padding ids)
            with self._warm_step(f"page copy pages={n}"), self._counter.watch():
                self.engine.read_pages(np.zeros(n, np.int32))
                self._write_bucket(np.full(n, spec.num_pages, np.int32), self._zero_pages(n))

    def _decode_idle_rows(self, size: int, pages: int) -> None:
        """A decode step of `size` idle rows (length 0: nothing is written) over page tables of `pages`
        pages, with the argument types of `decode`, to compile that batch size and table width."""
        slots = np.arange(size, dtype=np.int32)
        tokens = np.full(size, self.cfg.pad_token_id, np.int32)
        self._decode_rows(
            slots, tokens, np.zeros(size, np.int32), np.zeros(size, bool),
            np.zeros((size, pages), np.int32), SamplingBatch.broadcast(size),
        )  # fmt: skip
        for s in slots:  # idle rows moved no history, but the slots are free: leave them fresh
            self.engine.reset_history(int(s))

    def _speculative_idle_rows(self, size: int, width: int, pages: int) -> None:
        """A speculative step of `size` idle rows at draft width `width` over page tables of `pages`
        pages (nothing is written), with the argument types of `_speculative`, to compile that
        program."""
        slots = np.arange(size, dtype=np.int32)
        self._speculative_rows(
            slots, np.full(size, self.cfg.pad_token_id, np.int32), np.zeros((size, width), np.int32),
            np.zeros(size, np.int32), np.zeros(size, np.int32), np.zeros(size, bool),
            np.zeros((size, pages), np.int32),
            SamplingBatch.broadcast(
                size, token_bitmask=np.full((size, width + 1, mask_words(self.cfg.vocab_size)), -1, np.int32)
            ),
        )  # fmt: skip
        for s in slots:
            self.engine.reset_history(int(s))

    def _speculative_rows(self, slots, tokens, drafts, n_drafts, positions, active, page_tables, sampling):
        """The speculative program of drafts' width over the rows `slots` (host results)."""
        with self._counter.watch():
            return self.engine.speculative_decode(
                slots, tokens, drafts, n_drafts, positions, active, page_tables, sampling,
                max_logprobs=self.max_logprobs,
            )  # fmt: skip

    def kv_fingerprint(self) -> bytes:
        """The page layout, config and every weight byte (`weights_id`), computed once: a disk tier
        keeps pages across processes, and a page is valid only under the weights that wrote it."""
        if self._kv_fingerprint is None:
            self._kv_fingerprint = self.page_layout.fingerprint(weights_id(self.model))
        return self._kv_fingerprint

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        """One blob of `page_layout.page_bytes` per page (`ced_jax.engine.page_io`), read in the compiled
        page-count buckets (padded with repeats)."""
        ids = self._page_ids(pages)
        blobs = []
        step = self._page_buckets[-1] if self._page_buckets else max(len(ids), 1)
        for i in range(0, len(ids), step):
            part = ids[i : i + step]
            n = _bucket(len(part), self._page_buckets)
            padded = np.concatenate([part, np.full(n - len(part), part[0], np.int32)])
            with self._counter.watch():
                contents = self.engine.read_pages(padded)
            blobs += self.page_layout.pack(contents)[: len(part)]
        return blobs

    def write_pages(self, pages: Sequence[int], blobs: Sequence[bytes]) -> None:
        """Puts `blobs` into distinct `pages` (padding ids past num_pages are dropped by the program)."""
        ids = self._page_ids(pages)
        if len(set(ids.tolist())) != len(ids) or len(blobs) != len(ids):
            raise ValueError(f"write_pages: {len(blobs)} blobs for pages {ids.tolist()} (distinct, one each)")
        step = self._page_buckets[-1] if self._page_buckets else max(len(ids), 1)
        for i in range(0, len(ids), step):
            part, data = ids[i : i + step], list(blobs[i : i + step])
            n = _bucket(len(part), self._page_buckets)
            contents = self.page_layout.unpack(data + [bytes(self.page_layout.page_bytes)] * (n - len(part)))
            padded = np.concatenate([part, np.full(n - len(part), self._spec.num_pages, np.int32)])
            self._write_bucket(padded, contents)

    def _write_bucket(self, pages: np.ndarray, contents: dict) -> None:
        with self._counter.watch():
            self.engine.write_pages(pages, contents)

    def _zero_pages(self, n: int) -> dict:
        return self.page_layout.unpack([bytes(self.page_layout.page_bytes)] * n)

    def _page_ids(self, pages: Sequence[int]) -> np.ndarray:
        if not self._spec.kv_page_bytes:
            raise ValueError("this engine cannot move pages (a multi-host engine has no KV tiers)")
        ids = np.asarray(pages, np.int32).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self._spec.num_pages):
            raise ValueError(f"pages outside 0..{self._spec.num_pages - 1}: {ids.tolist()}")
        return ids

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        return self.prefill_batch([chunk])[0]

    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> list[PrefillResult]:
        return self.prefill_async(chunks).result()

    def prefill_async(self, chunks: Sequence[PrefillChunk]) -> _PendingPrefill:
        """Checks every chunk, then sets the Engram history of fresh slots (at their first chunk's start)
        and dispatches the `prefill_batch` program of
        the smallest `prefill_rows` size that holds the chunks (idle rows: distinct other slots
        with 0 tokens, which write nothing), or for one text chunk longer than the prefill chunk
        the long-prompt program (`long_prefill_step` tokens per forward)."""
        self._require_warm()
        if not 1 <= len(chunks) <= self.prefill_rows[-1]:
            raise ValueError(f"prefill batch of {len(chunks)} chunks outside 1..{self.prefill_rows[-1]}")
        slots = [c.slot for c in chunks]
        if len(set(slots)) != len(slots):
            raise ValueError(f"one chunk per slot in a prefill batch, got slots {slots}")
        for chunk in chunks:  # all checked before any state changes
            self._check_chunk(chunk)
        long = any(len(c.token_ids) > self.prefill_chunk for c in chunks)
        if long and (len(chunks) > 1 or chunks[0].token_types is not None):
            raise ValueError(
                f"a chunk of more than {self.prefill_chunk} tokens (the long-prompt program) goes alone "
                "and without image spans"
            )
        for chunk in chunks:
            if self._pos[chunk.slot] < 0:
                dead = None if chunk.history_types is None else np.asarray(chunk.history_types) >= 0
                history = self.engine.history_after(chunk.history, dead) if chunk.start_pos else None
                self.engine.reset_history(chunk.slot, history)
        per_slot = self._spec.max_slots // self.kv_blocks
        busiest = max(collections.Counter(c.slot // per_slot for c in chunks).values())
        fits = [r for r in self.prefill_rows if r >= busiest * self.kv_blocks]
        if not fits:  # only under data-parallel attention: one device block got too many chunks
            raise ValueError(
                f"prefill batch: {busiest} chunks on one device block, at most "
                f"{self.prefill_rows[-1] // self.kv_blocks} (prefill_rows / devices)"
            )
        if long:
            self.long_prefill_calls += 1
            rows = _PrefillRows.build(chunks, self.kv_blocks, self, width=self.long_prefill_chunk)
        else:
            rows = _PrefillRows.build(chunks, fits[0], self)
        self.blocks_used.update(c.slot // per_slot for c in chunks)
        pages = self._table_width(max(c.start_pos + len(c.token_ids) - 1 for c in chunks))
        self.prefill_widths_used[pages] += 1
        out = self._prefill_rows(
            dataclasses.replace(rows, page_tables=rows.page_tables[:, :pages]), long=long
        )
        for chunk in chunks:
            self._pos[chunk.slot] = chunk.start_pos + len(chunk.token_ids)
            if chunk.is_last_chunk:
                self._decoding[chunk.slot] = True
        row_of = [int(np.flatnonzero(rows.slots == c.slot)[0]) for c in chunks]
        return _PendingPrefill(list(chunks), out, row_of)

    def _check_chunk(self, chunk: PrefillChunk) -> None:
        spec = self._spec
        s, start, n = chunk.slot, chunk.start_pos, len(chunk.token_ids)
        if not 0 <= s < spec.max_slots:
            raise ValueError(f"slot {s} outside 0..{spec.max_slots - 1}")
        if not 1 <= n <= max(self.prefill_chunk, self.long_prefill_chunk):
            raise ValueError(
                f"chunk length {n} outside 1..{max(self.prefill_chunk, self.long_prefill_chunk)}"
            )
        if start % self.page_size or start + n > spec.max_context:
            raise ValueError(f"chunk [{start}, {start + n}) is not page aligned or runs past max_context")
        if self._decoding[s]:
            raise ValueError(f"slot {s} is decoding")
        if np.shape(chunk.page_table) != (spec.pages_per_slot,):
            want = (spec.pages_per_slot,)
            raise ValueError(f"page_table shape {np.shape(chunk.page_table)}, expected {want}")
        w = mask_words(self.cfg.vocab_size)
        if chunk.token_bitmask is not None and np.shape(chunk.token_bitmask) != (w,):
            raise ValueError(f"token_bitmask shape {np.shape(chunk.token_bitmask)}, expected {(w,)}")
        if (chunk.token_types is None) != (chunk.span_embeds is None):
            raise ValueError("token_types and span_embeds must be given together")
        if chunk.token_types is not None:
            if not spec.hidden_size:
                raise ValueError("this model has no vision tower: a chunk cannot carry image spans")
            if np.shape(chunk.token_types) != (n,):
                raise ValueError(f"token_types shape {np.shape(chunk.token_types)}, expected {(n,)}")
            if np.shape(chunk.span_embeds) != (n, spec.hidden_size):
                raise ValueError(
                    f"span_embeds shape {np.shape(chunk.span_embeds)}, expected {(n, spec.hidden_size)}"
                )
        fresh = self._pos[s] < 0
        if fresh:
            if start != chunk.window_floor:
                raise ValueError(
                    f"slot {s}: a fresh slot starts at its window_floor {chunk.window_floor}, not at {start} "
                    "(a prefix hit replays from there)"
                )
            if len(chunk.history) != min(start, spec.history_tokens):
                want = min(start, spec.history_tokens)
                raise ValueError(f"slot {s}: history of {len(chunk.history)} tokens, expected {want}")
            types = chunk.history_types
            if types is not None and np.shape(types) != np.shape(chunk.history):
                raise ValueError(f"history_types shape {np.shape(types)}, expected {np.shape(chunk.history)}")
        elif self._pos[s] != start:
            raise ValueError(f"slot {s}: chunk starts at {start}, state is at {self._pos[s]}")
        if not 0 <= chunk.window_floor <= start or chunk.write_from % self.page_size or chunk.write_from < 0:
            raise ValueError(
                f"window_floor {chunk.window_floor} / write_from {chunk.write_from}: the floor is at most "
                "the chunk start and write_from a page boundary"
            )
        if chunk.decoder_from and not spec.ced_window:
            raise ValueError("decoder_from: this model has no CED layout")

    def _prefill_rows(self, rows: _PrefillRows, long: bool = False):
        """The prefill program over `rows` (one compiled program per row count; `long`: the
        long-prompt one, `long_prefill_step` tokens per forward instead of a page)."""
        with self._counter.watch():
            return self.engine.prefill_batch(
                rows.slots, rows.tokens, rows.n, rows.start, rows.page_tables, rows.sampling,
                max_logprobs=self.max_logprobs, token_types=rows.token_types, span_embeds=rows.span_embeds,
                decoder_from=rows.decoder_from, window_floor=rows.window_floor, write_from=rows.write_from,
                step_tokens=self.long_prefill_step if long else None,
            )  # fmt: skip

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        return self.decode_async(batch).result()

    def decode_async(self, batch: DecodeBatch) -> _PendingDecode | Ready:
        self._require_warm()
        if batch.drafts is not None:
            return Ready(self._speculative(batch))
        active = np.asarray(batch.active, bool)
        tokens = np.asarray(batch.token_ids, np.int32)
        positions = np.asarray(batch.positions, np.int32)
        for s in np.flatnonzero(active):
            if not self._decoding[s] or self._pos[s] != positions[s]:
                raise ValueError(f"slot {s}: decode at {positions[s]}, state is at {self._pos[s]}")
            if positions[s] + 1 > self._spec.max_context:
                raise ValueError(f"slot {s}: decode past max_context")
        tables = (len(active), self._spec.pages_per_slot)
        if np.shape(batch.page_tables) != tables:
            raise ValueError(f"page_tables shape {np.shape(batch.page_tables)}, expected {tables}")
        w = mask_words(self.cfg.vocab_size)
        mask = batch.sampling.token_bitmask
        if mask is not None and np.shape(mask) != (len(active), w):
            raise ValueError(f"token_bitmask shape {np.shape(mask)}, expected {(len(active), w)}")
        # Inactive rows run with length 0 (nothing is written); their inputs only need to be valid.
        positions = np.where(active, positions, 0).astype(np.int32)
        tokens = np.where(active, tokens, self.cfg.pad_token_id).astype(np.int32)
        # The step runs the smallest decode bucket that holds the active rows: the active slots, then
        # distinct idle ones (length 0: they write nothing; distinct, so no two rows of the step
        # scatter into one slot). Results go back to their slots' rows; idle rows are garbage.
        slots = self._place_rows(active)
        n_active = int(active.sum())
        take = lambda a, dtype: np.asarray(a, dtype)[slots]
        pages = self._table_width(int(positions[active].max()) if n_active else 0)
        self.decode_widths_used[pages] += 1
        out = self._decode_rows(
            slots, tokens[slots], positions[slots], active[slots],
            take(batch.page_tables, np.int32)[:, :pages], _rows_of(batch.sampling, slots),
        )  # fmt: skip
        self._pos[active] += 1
        return _PendingDecode(out, slots, len(active))

    def _speculative(self, batch: DecodeBatch) -> DecodeResult:
        """A speculative step (`serving.engine.protocol`'s module docstring): rows bucketed as in
        `decode_async`, the program of the batch's draft width, results scattered back to their slots'
        rows."""
        spec = self._spec
        S, width, W = spec.max_slots, batch.draft_width, mask_words(self.cfg.vocab_size)
        if width not in self.dspark_widths:
            raise ValueError(f"drafts: width {width} is not one of the compiled {self.dspark_widths}")
        active = np.asarray(batch.active, bool)
        positions = np.asarray(batch.positions, np.int32)
        n_drafts = np.where(active, np.asarray(batch.drafts.n_drafts, np.int32), 0)
        for s in np.flatnonzero(active):
            if not self._decoding[s] or self._pos[s] != positions[s]:
                raise ValueError(f"slot {s}: decode at {positions[s]}, state is at {self._pos[s]}")
            if positions[s] + width >= spec.max_context:
                raise ValueError(
                    f"slot {s}: draft block [{positions[s]}, {positions[s] + width}] past max_context"
                )
        if np.shape(batch.page_tables) != (S, spec.pages_per_slot):
            shape = np.shape(batch.page_tables)
            raise ValueError(f"page_tables shape {shape}, expected {(S, spec.pages_per_slot)}")
        mask = batch.sampling.token_bitmask
        if mask is not None and np.shape(mask) != (S, width + 1, W):
            raise ValueError(f"token_bitmask shape {np.shape(mask)}, expected {(S, width + 1, W)}")
        positions = np.where(active, positions, 0).astype(np.int32)
        tokens = np.where(active, np.asarray(batch.token_ids, np.int32), self.cfg.pad_token_id)
        slots = self._place_rows(active)
        n_active = int(active.sum())
        take = lambda a, dtype: np.asarray(a, dtype)[slots]
        pages = self._table_width(int(positions[active].max()) + width if n_active else 0)
        self.decode_widths_used[pages] += 1
        out = self._speculative_rows(
            slots, tokens[slots].astype(np.int32), take(batch.drafts.drafts, np.int32),
            n_drafts[slots].astype(np.int32), positions[slots], active[slots],
            take(batch.page_tables, np.int32)[:, :pages], _rows_of(batch.sampling, slots),
        )  # fmt: skip
        full = []
        for a in out:
            a = np.asarray(a)
            dst = np.zeros((S, *a.shape[1:]), a.dtype)
            dst[slots] = a
            full.append(dst)
        accepted, tok, lp, ids, tlp, next_drafts, next_conf = full
        emitted = (accepted + 1).astype(np.int32)
        self._pos[active] += emitted[active]
        return DecodeResult(
            token_ids=tok, logprobs=lp, top_ids=ids, top_logprobs=tlp, emitted=emitted,
            next_drafts=next_drafts, next_confidence=next_conf,
        )  # fmt: skip

    def _place_rows(self, active: np.ndarray) -> np.ndarray:
        """The slots of a decode step's rows, i32 [size]: the smallest decode bucket that holds the
        active slots, each followed by distinct idle slots (length 0: they write nothing; distinct, so
        no two rows of the step scatter into one slot). Under data-parallel attention row block d
        holds block d's active slots, then idle slots of block d (each device runs its own)."""
        blocks, S = self.kv_blocks, len(active)
        per = S // blocks
        groups = [np.arange(d * per, (d + 1) * per) for d in range(blocks)]
        busiest = max(int(active[g].sum()) for g in groups)
        size = next(b for b in self.decode_buckets if b >= busiest * blocks)
        rows = []
        for g in groups:
            rows.append(np.concatenate([g[active[g]], g[~active[g]]])[: size // blocks])
        return np.concatenate(rows).astype(np.int32)

    def _table_width(self, last_position: int) -> int:
        """The page-table width (pages) of a step whose rows write up to `last_position`: the smallest
        compiled width that holds it (module docstring)."""
        return _bucket(last_position // self.page_size + 1, self.context_pages)

    def _decode_rows(self, slots, tokens, positions, active, page_tables, sampling: SamplingBatch):
        """The decode program over the rows `slots` (one compiled program per batch size), dispatched
        (outputs on the device); idle rows (active False) write nothing and keep their history. A
        None token_bitmask is all ones (the same program)."""
        with self._counter.watch():
            return self.engine.dispatch_decode(
                slots, tokens, positions, active, page_tables, sampling, max_logprobs=self.max_logprobs
            )

    def release(self, slot: int) -> None:
        self._pos[slot] = -1
        self._decoding[slot] = False
        self.engine.reset_history(slot)

    # ---- internals ----------------------------------------------------------------------------

    def _require_warm(self) -> None:
        if not self._warm:
            raise RuntimeError("JaxEngine.warmup() must run before serving calls")
