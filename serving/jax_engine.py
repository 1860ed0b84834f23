"""The serving engine: `JaxEngine` implements `serving.engine_api.Engine` over `ced_jax.engine`.

The device work is a `ced_jax.engine.Engine` (the one state, the model's `Programs`, the Engram history
per slot), the same engine the notebook API runs; this module adds what the scheduler's protocol needs
on top: slot bookkeeping and checks, decode batch buckets, prefix snapshots on the host, and warm-up.

Programs, compiled by `warmup()`, which runs each of them through the serving code path (a one-token
prefill and one decode step on slot 0, idle steps of the other decode batch sizes, a restore), so that
every later call finds its executable in jit's cache. The serving calls stay ordinary jit calls,
watched by a `CompileCounter` that counts JAX's own compilation events: a call whose shapes, dtypes or
shardings warm-up did not cover compiles, and shows in `compiles_after_warmup` (and on /metrics):
- prefill: one chunk of up to `prefill_chunk` tokens (the one bucket) of one slot, the engine's
  `prefill_pages` program (a `lax.while_loop` over its pages, `forward` on one page per iteration,
  then the sample after the chunk). The trip count is dynamic, so a short chunk costs only its pages.
- decode: one token for each row of a batch of the smallest `decode_buckets` size that holds the
  active slots (ServeConfig: 8, 16, 32 for 32 slots), padded with distinct idle slots of length 0
  (they write nothing), sampling inside (`ced_jax.sampling`), so only tokens and log-probabilities
  come back. A lone stream thus pays for 8 rows, not `max_slots`; why not 1, see
  `ServeConfig.decode_buckets`.
- restore: puts a snapshot's rings and partial groups into a slot.

Why a page per iteration: it makes prefix-cache hits exact by construction. Every page of a prompt
is computed by the same program from the same inputs (its tokens, position, the pages before it and
the slot state at its start), whether the request starts cold at 0 or resumes from a snapshot at a
page boundary, and however the scheduler cut the prompt into chunks. (A whole-chunk forward would
sum attention terms in an order that depends on where the chunk starts.) The price is prefill
matmuls of page_size rows; pick page_size accordingly on an accelerator.

Prefix snapshots (`restore_mode = "snapshot"`): after each full page the loop records the slot's
SWA rings and compressor partial groups (the partial group is in fact empty there, since page_size
is a multiple of every ratio; it is kept so that the snapshot is the whole slot state). When the
scheduler asks for boundaries, the recorded states are copied to the host with the Engram history
at the boundary; restoring one is the `restore` program plus setting the host history. Snapshots
live in host memory (num_layers * window * swa_entry_bytes each: 2.7 MB for v41-flash, 8 KB for
tiny), so dropping one only forgets it.

On a device mesh (`ced_jax.load(..., mesh=...)`, `ced-jax serve --mesh`), see `ced_jax.engine`: the
state is laid out by the model's rules and every program pins that layout.

A fresh slot needs no reset: at position 0 the ring is masked by position and the partial group is
not read, and pages past a sequence are never read unmasked (see `ced_jax.cache`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax.engine import Engine, StateShapes
from serving.config import ServeConfig
from serving.engine_api import (
    CompileCounter,
    DecodeBatch,
    DecodeResult,
    EngineSpec,
    PrefillChunk,
    PrefillResult,
    SampledToken,
    SamplingParams,
)


@dataclasses.dataclass(frozen=True, eq=False)
class JaxSnapshot:
    """The state of a slot at page boundary `pos`, on the host."""

    pos: int
    state: dict  # numpy tree of `ced_jax.cache.slot_state`
    history: np.ndarray | None  # Engram history [K-1] at pos


class ModelTokenizer:
    """`serving.text.Tokenizer` over a `ced_jax.api.Model`: encode prepends BOS, as `Model.encode`."""

    def __init__(self, model):
        self._model = model

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._model.decode_text(list(token_ids))


class JaxEngine:
    """`serving.engine_api.Engine` over a `ced_jax.api.Model` (see the module docstring)."""

    def __init__(self, model, config: ServeConfig):
        """Built with `config`'s shapes (max_slots, page_size, num_pages, max_context, its one prefill
        bucket: the chunk length) and max_logprobs; the rest of `config` is the server's."""
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
        self.decode_buckets = tuple(config.decode_buckets)
        self.max_logprobs = max_logprobs
        self.engine = Engine(
            model,
            StateShapes(
                max_slots=max_slots, page_size=page_size, num_pages=num_pages, max_context=max_context
            ),
        )
        kv_bytes = cache_lib.kv_bytes_per_token(self.engine.state)
        self._spec = EngineSpec(
            max_slots=max_slots,
            page_size=page_size,
            num_pages=num_pages,
            max_context=max_context,
            prefill_buckets=(prefill_chunk,),
            vocab_size=cfg.vocab_size,
            eos_token_ids=(cfg.eos_token_id,),
            max_logprobs=max_logprobs,
            restore_mode="snapshot",
            history_tokens=0,
            model_name=cfg.name,
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
        self.live_snapshots = 0

    # ---- Engine protocol ----------------------------------------------------------------------

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
        try:
            self._warm_up_programs()
        except BaseException:
            self._warm = False
            raise
        # Warm-up's own compiles are not "after warm-up".
        self._counter.count = 0

    def _warm_up_programs(self) -> None:
        """Compiles every program by calling it as serving does, with the same argument types.

        A one-token prefill into slot 0 (page 0) and one decode step, then the slot is released and
        given a zero state through `restore`. What they write is harmless: a fresh slot needs no reset
        and a page's entries are always written before they are read (module docstring)."""
        spec = self._spec
        table = np.zeros(spec.pages_per_slot, np.int32)
        greedy = SamplingParams(temperature=0.0)
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
        self.decode(
            DecodeBatch(
                token_ids=tokens, positions=positions, active=active,
                page_tables=np.zeros((S, spec.pages_per_slot), np.int32),
                temperature=np.zeros(S, np.float32), top_p=np.ones(S, np.float32),
                top_k=np.zeros(S, np.int32), seed=np.zeros(S, np.uint32),
            )
        )  # fmt: skip
        self.release(0)
        for size in self.decode_buckets:  # the step above compiled the smallest; idle rows for the rest
            if size == self.decode_buckets[0]:
                continue
            self._decode_idle_rows(size)
        self._restore_slot(0, self.engine.zero_slot_state(), None)

    def _decode_idle_rows(self, size: int) -> None:
        """A decode step of `size` idle rows (length 0: nothing is written), with the argument types of
        `decode`, to compile that batch size."""
        slots = np.arange(size, dtype=np.int32)
        tokens = np.full(size, self.cfg.pad_token_id, np.int32)
        self._decode_rows(
            slots, tokens, np.zeros(size, np.int32), np.zeros(size, bool),
            np.zeros((size, self._spec.pages_per_slot), np.int32), np.zeros(size, np.float32),
            np.ones(size, np.float32), np.zeros(size, np.int32), np.zeros(size, np.uint32),
        )  # fmt: skip
        for s in slots:  # idle rows moved no history, but the slots are free: leave them fresh
            self.engine.reset_history(int(s))

    def _restore_slot(self, slot: int, state: dict, history) -> None:
        with self._counter.watch():
            self.engine.restore_slot(slot, state, history)

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        spec, ps = self._spec, self.page_size
        s, start = chunk.slot, chunk.start_pos
        toks = np.asarray(chunk.token_ids, np.int32)
        n = len(toks)
        if not 1 <= n <= self.prefill_chunk:
            raise ValueError(f"chunk length {n} outside 1..{self.prefill_chunk}")
        if start % ps or start + n > spec.max_context:
            raise ValueError(f"chunk [{start}, {start + n}) is not page aligned or runs past max_context")
        if self._decoding[s]:
            raise ValueError(f"slot {s} is decoding")
        self._require_warm()
        fresh = self._pos[s] < 0
        with self._counter.watch():
            if chunk.restore is not None:
                snap = chunk.restore
                if not fresh or snap.pos != start:
                    raise ValueError("restore only on a fresh slot at the snapshot's position")
                self._restore_slot(s, snap.state, snap.history)
            elif fresh:
                if start:
                    raise ValueError(f"slot {s}: resuming at {start} needs a snapshot")
                self.engine.reset_history(s)
            elif self._pos[s] != start:
                raise ValueError(f"slot {s}: chunk starts at {start}, state is at {self._pos[s]}")
            padded = np.full(self.prefill_chunk, self.cfg.pad_token_id, np.int32)
            padded[:n] = toks
            history = self.engine.history[s : s + 1].copy()
            sp = chunk.sampling
            out, snaps = self.engine.prefill_pages(
                s, padded, n, start, chunk.page_table, sp.temperature, sp.top_p, sp.top_k, sp.seed,
                max_logprobs=self.max_logprobs,
            )  # fmt: skip
            snapshots = {}
            if chunk.snapshot_at:
                host = jax.device_get(snaps)
                for b in chunk.snapshot_at:
                    k = (b - start) // ps - 1
                    if b % ps or not 0 <= k < n // ps:
                        raise ValueError(f"snapshot position {b} is not a full page boundary of the chunk")
                    hist = None
                    if self.hasher is not None:
                        m = b - start
                        hist = self.hasher.next_history(history, toks[None, :m], np.array([m]))[0]
                    snapshots[b] = JaxSnapshot(b, jax.tree.map(lambda a, k=k: a[k].copy(), host), hist)
                    self.live_snapshots += 1
            self._pos[s] = start + n
            if not chunk.is_last_chunk:
                return PrefillResult(token=None, snapshots=snapshots)
            self._decoding[s] = True
            tok, lp, ids, tlp = jax.device_get(out)
        token = SampledToken(token_id=int(tok[0]), logprob=float(lp[0]), top_ids=ids[0], top_logprobs=tlp[0])
        return PrefillResult(token=token, snapshots=snapshots)

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        self._require_warm()
        active = np.asarray(batch.active, bool)
        tokens = np.asarray(batch.token_ids, np.int32)
        positions = np.asarray(batch.positions, np.int32)
        for s in np.flatnonzero(active):
            if not self._decoding[s] or self._pos[s] != positions[s]:
                raise ValueError(f"slot {s}: decode at {positions[s]}, state is at {self._pos[s]}")
            if positions[s] + 1 > self._spec.max_context:
                raise ValueError(f"slot {s}: decode past max_context")
        # Inactive rows run with length 0 (nothing is written); their inputs only need to be valid.
        positions = np.where(active, positions, 0).astype(np.int32)
        tokens = np.where(active, tokens, self.cfg.pad_token_id).astype(np.int32)
        # The step runs the smallest decode bucket that holds the active rows: the active slots, then
        # distinct idle ones (length 0: they write nothing; distinct, so no two rows of the step
        # scatter into one slot). Results go back to their slots' rows; idle rows are garbage.
        idle = np.flatnonzero(~active)
        n_active = len(active) - len(idle)
        size = next(b for b in self.decode_buckets if b >= n_active)
        slots = np.concatenate([np.flatnonzero(active), idle[: size - n_active]]).astype(np.int32)
        take = lambda a, dtype: np.asarray(a, dtype)[slots]
        out = self._decode_rows(
            slots, tokens[slots], positions[slots], active[slots], take(batch.page_tables, np.int32),
            take(batch.temperature, np.float32),
            take(batch.top_p, np.float32), take(batch.top_k, np.int32), take(batch.seed, np.uint32),
        )  # fmt: skip
        self._pos[active] += 1
        full = lambda a: np.zeros((len(active), *a.shape[1:]), a.dtype)
        result = [full(a) for a in out]
        for dst, src in zip(result, out, strict=True):
            dst[slots] = src
        tok, lp, ids, tlp = result
        return DecodeResult(token_ids=tok, logprobs=lp, top_ids=ids, top_logprobs=tlp)

    def _decode_rows(self, slots, tokens, positions, active, page_tables, temperature, top_p, top_k, seed):
        """The decode program over the rows `slots` (one compiled program per batch size); idle rows
        (active False) write nothing and keep their history."""
        with self._counter.watch():
            return self.engine.decode(
                slots, tokens, positions, active, page_tables, temperature, top_p, top_k, seed,
                max_logprobs=self.max_logprobs,
            )  # fmt: skip

    def release(self, slot: int) -> None:
        self._pos[slot] = -1
        self._decoding[slot] = False
        self.engine.reset_history(slot)

    def drop_snapshot(self, snapshot) -> None:
        # Host memory: forgetting the handle frees it.
        self.live_snapshots -= 1

    # ---- internals ----------------------------------------------------------------------------

    def _require_warm(self) -> None:
        if not self._warm:
            raise RuntimeError("JaxEngine.warmup() must run before serving calls")
