"""The engine's host side: `LoadedModel` (what an engine runs) and `Engine`, one device state of
`StateShapes` with the Engram history that goes with it, whose calls build each program's
`StepBatch` from host arrays (see `ced_jax.engine.programs` for the programs)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import numpy as np

from ced_jax import sharding
from ced_jax.cache import StepMetadata
from ced_jax.config import ModelConfig
from ced_jax.engine.batch import ImageInputs, SamplingBatch, StepBatch
from ced_jax.engine.programs import Programs, StateShapes, floor_per_layer, new_state
from ced_jax.options import REFERENCE, Impl, RunOptions
from ced_jax.sampling import mask_words

# The model programs an `Engine` runs (`run`), by their `Programs` attribute.
PROGRAMS = frozenset({"step", "decode", "prefill_batch", "speculative_decode"})


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What an `Engine` runs: the config, the placed parameters (`ced_jax.checkpoint.place`), the Engram
    hasher and host tables (None without them, or with the tables on device), the mesh and its rules
    (None, {} on one device) and the kernel choice; the programs are shared by every engine of it."""

    cfg: ModelConfig
    params: dict
    hasher: object = None
    engram_store: object = None
    mesh: jax.sharding.Mesh | None = None
    rules: dict = dataclasses.field(default_factory=dict)
    impl: Impl = REFERENCE

    @functools.cached_property
    def programs(self) -> Programs:
        return Programs.shared(self.cfg, mesh=self.mesh, rules=self.rules)

    @functools.cached_property
    def draft_programs(self) -> Programs:
        """The programs of speculative engines: the prefill also inserts the DSpark context, and
        `speculative_decode` exists."""
        return Programs.shared(self.cfg, mesh=self.mesh, rules=self.rules, with_draft=True)

    @property
    def has_draft_stages(self) -> bool:
        """Whether the DSpark draft stages are loaded (params["mtp"])."""
        return "mtp" in self.params

    def put_input(self, arr):
        """A host input of a step: on one device the numpy array itself (jit transfers it; a
        `jnp.asarray` would run a small program of its own per new shape), on a mesh replicated
        (global array)."""
        if self.mesh is None:
            return np.asarray(arr)
        return sharding.put_global(arr, sharding.replicated(self.mesh))


class SpeculativeOutput(NamedTuple):
    """A speculative step on the host (rows as the call's; inactive rows are garbage)."""

    accepted: np.ndarray  # i32 [B]: drafts accepted, 0..n_drafts
    tokens: np.ndarray  # i32 [B, K+1]: row b emits tokens[b, :accepted[b] + 1]
    logprob: np.ndarray  # f32 [B, K+1]: of each emitted token under the raw target distribution
    top_ids: np.ndarray  # i32 [B, K+1, N]
    top_logprobs: np.ndarray  # f32 [B, K+1, N]
    next_drafts: np.ndarray  # i32 [B, block]: drafts for the next step
    next_confidence: np.ndarray  # f32 [B, block]: confidence head (sigmoid = estimated acceptance)


class Engine:
    """One device state of `shapes` and the host state that goes with it (the Engram history per
    slot), run by a model's `Programs`. Clients say which slots and pages a call uses; the engine
    checks nothing about scheduling (that is the client's job) but keeps the history in step."""

    def __init__(self, model: LoadedModel, shapes: StateShapes, *, with_draft: bool = False):
        """with_draft: a speculative engine (`speculative_decode`; prefill inserts the DSpark context);
        the model must carry the DSpark stages."""
        self.model, self.cfg, self.shapes = model, model.cfg, shapes
        if with_draft and not model.has_draft_stages:
            raise ValueError(
                "with_draft: the model has no DSpark stages loaded (load it with its mtp.* tensors)"
            )
        self.with_draft = with_draft
        self.impl = model.impl
        self.programs: Programs = model.draft_programs if with_draft else model.programs
        self.hasher = model.hasher
        # Engram tables on the host (placement "host"): each step's rows are gathered here.
        self.engram_store = model.engram_store
        self.mesh, self.rules = model.mesh, model.rules
        self.state = new_state(self.cfg, shapes, self.mesh, self.rules, with_draft=with_draft)
        self.history = self.empty_history(shapes.max_slots)
        layout = sharding.make_layout(self.mesh, self.rules)
        # Data-parallel attention (`dp_ep`): row block d of every call must use slots and pages of
        # block d (`ced_jax.model.forward`); `metadata` checks it.
        self.attention_shards = 1 if layout is None else layout.attention_shards
        # A multi-host leader's hand-over (`serving.engine.multihost.Mirror`): called as
        # `mirror(program, batch, options)`, a context around every program run (`run`).
        self.mirror = None

    # ---- host inputs
    def put(self, arr):
        """A host input of a step, on the device (`LoadedModel.put_input`)."""
        return self.model.put_input(arr)

    def empty_history(self, rows: int) -> np.ndarray:
        if self.hasher is None:
            return np.zeros((rows, 0), np.int64)
        return self.hasher.empty_history(rows)

    def reset_history(self, slot: int, history: np.ndarray | None = None) -> None:
        """A fresh sequence in `slot` (or one resumed mid-sequence, whose history is given:
        `history_after`)."""
        self.history[slot] = self.empty_history(1)[0] if history is None else history

    def history_after(self, tokens: np.ndarray, dead: np.ndarray | None = None) -> np.ndarray:
        """The Engram history of one sequence after its first tokens i32 [T] (dead bool [T]: image-span
        positions), for a prefill that resumes at T (a prefix hit's replay): only the last K - 1
        tokens matter, so a caller may pass just those when T >= K - 1."""
        if self.hasher is None:
            return self.empty_history(1)[0]
        tokens = np.asarray(tokens, np.int64)[None]
        dead = None if dead is None else np.asarray(dead, bool)[None]
        lens = np.array([tokens.shape[1]], np.int64)
        return self.hasher.next_history(self.empty_history(1), tokens, lens, dead)[0]

    def engram_rows(
        self, slots: np.ndarray, tokens: np.ndarray, lens: np.ndarray, dead: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The Engram hash rows i32 [B, T, n_engram_layers, C] of a chunk [B, T] of these slots (None
        without Engram); their histories move past it. dead: bool [B, T], True at image-span tokens
        (DEAD in the n-gram history, spec 4.4)."""
        if self.hasher is None:
            return None
        history = self.history[slots]
        rows = self.hasher.hash_ids(history, tokens, dead)
        self.history[slots] = self.hasher.next_history(history, tokens, np.asarray(lens, np.int64), dead)
        return rows

    def engram_inputs(self, ids: np.ndarray | None):
        """What a program takes for hash rows `ids`: the ids themselves (tables on device) or the
        table rows gathered on the host (`EngramStore.gather`: FP8 values + ue8m0 scales)."""
        if ids is None or self.engram_store is None:
            return ids
        return self.engram_store.gather(ids)

    def image_inputs(self, tokens: np.ndarray, token_types, span_embeds):
        """Check a chunk's image inputs against tokens [B, T]: (token_types i32 [B, T], span_embeds
        f32 [B, T, D], dead bool [B, T]), or (None, None, None) for a text-only chunk."""
        if token_types is None and span_embeds is None:
            return None, None, None
        if token_types is None or span_embeds is None:
            raise ValueError("token_types and span_embeds must be given together")
        types = np.asarray(token_types)
        if types.shape != tokens.shape or not np.issubdtype(types.dtype, np.integer):
            raise ValueError(
                f"token_types: expected integers of shape {list(tokens.shape)}, "
                f"got {types.dtype} {list(types.shape)}"
            )
        if types.size and (types.min() < -1 or types.max() > 3):
            raise ValueError("token_types: values must be -1 (text) or 0..3 (image span)")
        spans = np.asarray(span_embeds, np.float32)
        want = (*tokens.shape, self.cfg.hidden_size)
        if spans.shape != want:
            raise ValueError(f"span_embeds: expected shape {list(want)}, got {list(spans.shape)}")
        types = types.astype(np.int32)
        return types, spans, types >= 0

    def metadata(self, start, lens, slots, page_tables, window_floor=None) -> StepMetadata:
        """The rows of a call, host arrays; window_floor: i32 [B, L] (`StepMetadata.window_floor`) or
        None."""
        if self.attention_shards > 1:
            self._check_blocks(start, lens, slots, page_tables)
        i32 = lambda a: np.asarray(a, np.int32)
        return StepMetadata(
            start=i32(start),
            lens=i32(lens),
            slots=i32(slots),
            page_tables=i32(page_tables),
            window_floor=None if window_floor is None else i32(window_floor),
        )

    def _check_blocks(self, start, lens, slots, page_tables) -> None:
        """Under data-parallel attention: every working row's slot, and the pages holding its
        positions so far, lie in its device's block (else its writes would be dropped: a bug in the
        client's allocation, named here rather than found as wrong tokens)."""
        shards, shapes = self.attention_shards, self.shapes
        slots, lens = np.asarray(slots), np.asarray(lens)
        start, tables = np.asarray(start), np.asarray(page_tables)
        rows = len(slots)
        if rows % shards:
            raise ValueError(f"data-parallel attention over {shards} devices: {rows} rows is not a multiple")
        per_rows, per_slots = rows // shards, shapes.max_slots // shards
        per_pages = shapes.num_pages // shards
        for b in np.nonzero(lens > 0)[0]:
            block = b // per_rows
            if slots[b] // per_slots != block:
                raise ValueError(
                    f"row {b} (device block {block}) uses slot {slots[b]}, which lives in block "
                    f"{slots[b] // per_slots}: under data-parallel attention a row's slot is on its device"
                )
            used = tables[b, : -(-int(start[b] + lens[b]) // shapes.page_size)]
            wrong = used[used // per_pages != block]
            if wrong.size:
                raise ValueError(
                    f"row {b} (device block {block}) addresses page {wrong[0]} of block "
                    f"{wrong[0] // per_pages}: under data-parallel attention a row's pages are on its device"
                )

    def decoder_floor(self, rows: int, decoder_from) -> np.ndarray:
        """i32 [rows, L] window floors of rows whose decoder layers run from decoder_from [rows] on
        (CED prefill; `floor_per_layer` with no floor below the decoder)."""
        self.cfg.ced_boundary  # noqa: B018 (raises for a model without the CED layout)
        return floor_per_layer(self.cfg, np.zeros(rows, np.int32), decoder_from)

    def checked_sampling(self, sampling: SamplingBatch, mask_shape: tuple[int, ...]) -> SamplingBatch:
        """A call's sampling inputs (one row per call row) as the program takes them: checked, in
        their dtypes, token_bitmask None (no constraint) as all ones of `mask_shape`, so a program
        always gets the same shape and dtype, one executable either way."""
        rows = mask_shape[0]
        mask = sampling.token_bitmask
        mask = np.full(mask_shape, -1, np.int32) if mask is None else np.asarray(mask, np.int32)
        if mask.shape != mask_shape:
            raise ValueError(f"token_bitmask: expected shape {list(mask_shape)}, got {list(mask.shape)}")
        fields = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "seed": np.uint32}
        values = {name: np.asarray(getattr(sampling, name), dtype) for name, dtype in fields.items()}
        for name, value in values.items():
            if value.shape != (rows,):
                raise ValueError(f"{name}: expected {rows} values, got shape {list(value.shape)}")
        return SamplingBatch(**values, token_bitmask=mask)

    def _mesh_context(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # ---- calls
    def run(self, program: str, batch: StepBatch, options: RunOptions):
        """Run one of `PROGRAMS` on a batch of host arrays (`engram`: the hash rows): the state moves,
        the program's outputs stay on the device. The one place the engine runs a model program; a
        multi-host leader's `mirror` hands the same three values to the other processes first."""
        if program not in PROGRAMS:
            raise ValueError(f"program must be one of {sorted(PROGRAMS)}, got {program!r}")
        with contextlib.nullcontext() if self.mirror is None else self.mirror(program, batch, options):
            inputs = dataclasses.replace(batch, engram=self.engram_inputs(batch.engram))
            inputs = jax.tree.map(self.put, inputs)
            with self._mesh_context():
                self.state, out = getattr(self.programs, program)(
                    self.model.params, self.state, inputs, options=options
                )
        return out

    def step(
        self,
        tokens: np.ndarray,
        start: np.ndarray,
        lens: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        *,
        forced: dict | None = None,
        capture_blocks: bool = False,
        index_k_mode: str = "intended",
        token_types: np.ndarray | None = None,
        span_embeds: np.ndarray | None = None,
        window_floor: np.ndarray | None = None,
        stop_at_layer: int | None = None,
    ):
        """Run a chunk tokens [B, T] of rows `slots` (lens valid tokens each): (logits, aux) on device.
        token_types i32 [B, T] / span_embeds f32 [B, T, D]: image spans (see `forward`); None for
        both runs the text program. window_floor i32 [B, L] (`StepMetadata.window_floor`) and
        stop_at_layer (`forward`'s; logits None): CED prefill's two passes (`decoder_floor`,
        `ModelConfig.ced_boundary`)."""
        tokens = np.asarray(tokens, np.int32)
        types, spans, dead = self.image_inputs(tokens, token_types, span_embeds)
        rows = self.engram_rows(np.asarray(slots), tokens, lens, dead)
        batch = StepBatch(
            tokens=tokens,
            meta=self.metadata(start, lens, slots, page_tables, window_floor),
            engram=rows,
            images=None if types is None else ImageInputs(types, spans),
            forced=forced,
        )
        options = RunOptions(
            impl=self.impl,
            index_keys=index_k_mode,
            capture_blocks=capture_blocks,
            stop_at_layer=stop_at_layer,
        )
        return self.run("step", batch, options)

    def decode(
        self,
        slots,
        tokens,
        positions,
        active,
        page_tables,
        sampling: SamplingBatch,
        *,
        max_logprobs,
    ):
        """One token for each row (row i is slot slots[i]; inactive rows idle): the sampler's outputs
        on the host (token, logprob, top ids, top logprobs), one row each."""
        return jax.device_get(
            self.dispatch_decode(
                slots, tokens, positions, active, page_tables, sampling, max_logprobs=max_logprobs
            )
        )

    def dispatch_decode(
        self,
        slots,
        tokens,
        positions,
        active,
        page_tables,
        sampling: SamplingBatch,
        *,
        max_logprobs,
    ):
        """`decode` without waiting: the sampler's outputs stay on the device (JAX dispatch is
        asynchronous), so the host can prepare other work while the step runs; `jax.device_get`
        them when needed. The history moves at once (it needs only the fed tokens).
        sampling.token_bitmask: i32 [B, W] (`ced_jax.sampling.apply_token_bitmask`), None =
        unconstrained."""
        tokens = np.asarray(tokens, np.int32)
        lens = np.asarray(active, np.int32)
        rows = self.engram_rows(np.asarray(slots), tokens[:, None], lens)
        batch = StepBatch(
            tokens=tokens,
            meta=self.metadata(positions, lens, slots, page_tables),
            engram=rows,
            sampling=self.checked_sampling(sampling, (len(tokens), mask_words(self.cfg.vocab_size))),
        )
        return self.run("decode", batch, RunOptions(impl=self.impl, max_logprobs=max_logprobs))

    def prefill_batch(
        self,
        slots,
        padded_tokens,
        n,
        start,
        page_tables,
        sampling: SamplingBatch,
        *,
        max_logprobs,
        token_types=None,
        span_embeds=None,
        decoder_from=None,
        window_floor=None,
        write_from=None,
        step_tokens=None,
    ):
        """Chunks of R slots at once, `step_tokens` (None: a page) of every row per iteration
        (`prefill_batch` program):
        padded_tokens [R, C], n [R] valid (0: an idle row, whose history does not move). Returns the
        sample outputs on device [R]; nothing is waited for. Each row's history moves past its n
        tokens. sampling: a row per chunk (token_bitmask i32 [R, W], None: unconstrained). token_types i32
        [R, C] (-1 everywhere in text rows and padding) and span_embeds f32 [R, C, D] (rows of
        image-span positions, others ignored): image spans, whose Engram history slots are DEAD;
        None for both = the text program. A text chunk gives the same logits and state through
        either program (tests/ced_jax/test_vision_engine.py).
        decoder_from / window_floor / write_from i32 [R] (None: zeros): the program's (CED prefill's
        decoder bounded replay; a replay that rebuilds the rings and leaves the cached pages)."""
        slots = np.asarray(slots, np.int32)
        tokens = np.asarray(padded_tokens, np.int32)
        n = np.asarray(n, np.int32)
        zeros = np.zeros(len(slots), np.int32)
        per_row = lambda a: zeros if a is None else np.asarray(a, np.int32)
        if decoder_from is not None and np.any(np.asarray(decoder_from) > np.asarray(start)):
            self.cfg.ced_boundary  # noqa: B018 (raises for a model without the CED layout)
        if self.attention_shards > 1:
            self._check_blocks(start, n, slots, page_tables)
        types, spans, dead = self.image_inputs(tokens, token_types, span_embeds)
        rows = self.engram_rows(slots, tokens, n, dead)
        decoder_from = per_row(decoder_from)
        meta = StepMetadata(
            start=np.asarray(start, np.int32),
            lens=n,
            slots=slots,
            page_tables=np.asarray(page_tables, np.int32),
            window_floor=floor_per_layer(self.cfg, per_row(window_floor), decoder_from),
            write_from=per_row(write_from),
            decoder_from=decoder_from,
        )
        batch = StepBatch(
            tokens=tokens,
            meta=meta,
            engram=rows,
            sampling=self.checked_sampling(sampling, (len(slots), mask_words(self.cfg.vocab_size))),
            images=None if types is None else ImageInputs(types, spans),
        )
        options = RunOptions(impl=self.impl, max_logprobs=max_logprobs, step_tokens=step_tokens)
        return self.run("prefill_batch", batch, options)

    def speculative_decode(
        self,
        slots,
        tokens,
        drafts,
        n_drafts,
        positions,
        active,
        page_tables,
        sampling: SamplingBatch,
        *,
        max_logprobs,
    ) -> SpeculativeOutput:
        """One speculative step for each row (row i is slot slots[i]; inactive rows idle): verify the
        first n_drafts[i] of drafts[i] (i32 [B, K], the previous step's next_drafts; 0 right after a
        prefill) after tokens[i] (the row's last emitted token, at positions[i]), as the program
        `speculative_decode` describes. Page tables must cover positions up to positions + K.
        sampling.token_bitmask: i32 [B, K+1, W] (mask j for the token after j accepted drafts), None =
        unconstrained. The Engram history moves past the fed tokens that were kept. Returns the
        host `SpeculativeOutput`."""
        if not self.with_draft:
            raise ValueError("speculative_decode: this engine was built without with_draft=True")
        drafts = np.asarray(drafts, np.int32)
        b, width = drafts.shape
        if not 1 <= width <= self.cfg.dspark_block_size:
            raise ValueError(f"drafts: width must be 1..{self.cfg.dspark_block_size}, got {width}")
        if width + 1 > self.cfg.sliding_window:
            raise ValueError(f"drafts: width + 1 must fit the SWA window {self.cfg.sliding_window}")
        n_drafts = np.asarray(n_drafts, np.int32)
        if n_drafts.shape != (b,) or n_drafts.min(initial=0) < 0 or n_drafts.max(initial=0) > width:
            raise ValueError(f"n_drafts: expected {b} values in 0..{width}, got {n_drafts.tolist()}")
        active = np.asarray(active, bool)
        chunk = np.concatenate([np.asarray(tokens, np.int32)[:, None], drafts], axis=1)
        lens = np.where(active, n_drafts + 1, 0).astype(np.int32)
        slots = np.asarray(slots, np.int32)
        history = None
        rows = None
        if self.hasher is not None:
            history = self.history[slots]
            rows = self.hasher.hash_ids(history, chunk, None)
        batch = StepBatch(
            tokens=chunk,
            meta=self.metadata(positions, lens, slots, page_tables),
            engram=rows,
            sampling=self.checked_sampling(sampling, (b, width + 1, mask_words(self.cfg.vocab_size))),
        )
        options = RunOptions(impl=self.impl, max_logprobs=max_logprobs)
        out = SpeculativeOutput(*jax.device_get(self.run("speculative_decode", batch, options)))
        if history is not None:
            kept = np.where(active, out.accepted + 1, 0).astype(np.int64)
            self.history[slots] = self.hasher.next_history(history, chunk, kept, None)
        return out

    def read_pages(self, pages: np.ndarray) -> dict:
        """`page_io.read_pages` of the current state, on the host (i32 [n] page ids)."""
        with self._mesh_context():
            out = self.programs.read_pages(self.state, self.put(np.asarray(pages, np.int32)))
        return jax.device_get(out)

    def write_pages(self, pages: np.ndarray, contents: dict) -> None:
        """The state with `contents` (a `read_pages` result) in `pages` (distinct; ids >= num_pages
        are dropped, for padding)."""
        with self._mesh_context():
            self.state = self.programs.write_pages(
                self.state, self.put(np.asarray(pages, np.int32)), jax.tree.map(self.put, contents)
            )
