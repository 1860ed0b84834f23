"""The engine: one device state, one step function, the programs every client runs.

State. The only device state is a `ced_jax.cache.PagedCache` (packed FP4 compressed KV in page
buffers, packed FP8 SWA rings and f32 compressor partial groups per slot), immutable, passed to every
program and donated by name (`state`); a program returns the new state. What one call does is a
`ced_jax.cache.StepMetadata` (start, lens, slots, page tables). The Engram n-gram history is host
state, one array per engine (`Engine.history`): the hash is int64 integer work on token ids that the
spec puts on the host ahead of the step (`ced_jax.engram_hash`), and the rows it names are sent with
the tokens: as ids when the model's Engram tables are on device, or (placement `host`, the tables in
the model's `ced_jax.engram_store.EngramStore`) as the gathered table rows themselves, so the device
holds no Engram table (`Engine.engram_rows`).

Programs (`Programs`, jitted once per model and shared by all its engines; jit caches one executable
per shape):
- `step`: `forward` over a chunk of every row (the notebook API's prefill chunks and teacher-forced
  decoding, with capture / replay / patching); returns logits and the decisions taken.
- `decode`: one token per row, then `ced_jax.sampling.sample` inside, so only the drawn tokens and
  log-probabilities come back (`generate`'s decode and the server's). Each row's sample is under a
  packed token mask (constrained decoding; all ones when a client passes none), an argument like
  the others, so constraints never change the program.
- `prefill_batch`: chunks of R slots (the server's prefill), as a `lax.while_loop` over their pages:
  `forward` on [R, page_size] per iteration (a row whose chunk is done brings 0 tokens and writes
  nothing), then each row's (masked) sample after its chunk. Every page of a prompt is computed by the
  same program from the same inputs whether a request starts cold or replays after a prefix hit
  (`replay_tokens`: window_floor / write_from rebuild a slot's rings from cached tokens without
  writing the cached pages), so prefix hits are exact (`serving.engine.jax_engine`).

Image spans (spec 6.3). `step` and `prefill_batch` also take `token_types` i32 [B|R, T|C] (-1 text,
0..3 the START / IMAGE / NEWLINE / END of a span) and `span_embeds` f32 [B|R, T|C, D] (the ViT +
aligner rows and delimiter vectors, `ced_jax.vision`); None for both traces the text program, the
arrays a second executable, and a text chunk gives bit-identical logits and state through either (so
prefix-cache pages are interchangeable). The Engram history marks span positions DEAD. Decode steps
are text.

Clients: `ced_jax.api.Model` (a `Session` is an `Engine` of `batch` slots with contiguous page tables)
and `serving.engine.jax_engine.JaxEngine` (an `Engine` whose page tables come from the scheduler).

On a device mesh the programs run under the model's sharding rules; the state is laid out by
`ced_jax.cache.paged_cache_axes` (per-slot state over `batch`, page buffers over `pages`: replicated,
or under `dp_ep` a block per device, whose rows must use that block's slots and pages) and every
program pins that layout on its output, so a donated state never changes layout; what the host
reads comes back replicated, so every process of a multi-host run holds all of it.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax import sharding
from ced_jax.cache import PagedCache, StepMetadata
from ced_jax.config import ModelConfig
from ced_jax.engine import page_io
from ced_jax.engine.batch import SamplingBatch, StepBatch
from ced_jax.model import dspark as dspark_lib
from ced_jax.model import forward
from ced_jax.options import RunOptions
from ced_jax.sampling import sample, speculative_sample


@dataclasses.dataclass(frozen=True)
class StateShapes:
    """The static shapes of an engine's state: slots (sequences in flight), tokens per page, pages in
    the pool, and the longest sequence (pages per slot = max_context / page_size)."""

    max_slots: int
    page_size: int
    num_pages: int
    max_context: int

    def __post_init__(self):
        for name in ("max_slots", "page_size", "num_pages", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context % self.page_size:
            raise ValueError(
                f"max_context {self.max_context} is not a multiple of page_size {self.page_size}"
            )

    @property
    def pages_per_slot(self) -> int:
        return self.max_context // self.page_size


def state_shardings(state, mesh, rules):
    """NamedShardings of a state (arrays or ShapeDtypeStructs) on `mesh` under `rules`."""
    return sharding.logical_shardings(cache_lib.paged_cache_axes(state), state, mesh, rules)


def new_state(
    cfg: ModelConfig, shapes: StateShapes, mesh=None, rules=None, *, with_draft: bool = False
) -> PagedCache:
    """A zeroed state; on a mesh built in place, already laid out (no host copy, global across processes).
    with_draft: with the DSpark stages' context rings and each slot's last drafts' distributions."""
    make = partial(
        cache_lib.init_paged_cache,
        cfg,
        max_slots=shapes.max_slots,
        page_size=shapes.page_size,
        num_pages=shapes.num_pages,
        draft_stages=cfg.num_nextn_predict_layers if with_draft else 0,
        draft_vocab=cfg.vocab_size if with_draft else 0,
        draft_block=cfg.dspark_block_size if with_draft else 0,
    )
    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=state_shardings(jax.eval_shape(make), mesh, rules))()


# ------------------------------------------------------------------------------------ programs


def _pin(state, mesh, rules):
    return (
        state
        if mesh is None
        else jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, rules))
    )


def _replicated(tree, mesh):
    if mesh is None:
        return tree
    whole = sharding.replicated(mesh)
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, whole), tree)


def step(params, state, batch: StepBatch, *, options: RunOptions, cfg, mesh, rules, with_draft):
    """`forward` over a chunk of every row: (new state, (logits [B, T, V], aux)). batch.images: image
    spans (`forward`), None = text only (its own executable). with_draft: also insert the chunk's context
    into the DSpark stages' rings. options.stop_at_layer: `forward`'s (CED prefill's encoder pass:
    logits None, no DSpark context)."""
    meta, images = batch.meta, batch.images
    stopped = options.stop_at_layer is not None
    logits, state, aux = forward(
        params,
        cfg,
        batch.tokens,
        state,
        meta,
        batch.engram,
        batch.forced,
        token_types=None if images is None else images.token_types,
        span_embeds=None if images is None else images.span_embeds,
        capture_blocks=options.capture_blocks,
        capture_main_hidden=with_draft and not stopped,
        index_keys=options.index_keys,
        impl=options.impl,
        layout=sharding.make_layout(mesh, rules),
        stop_at_layer=options.stop_at_layer,
    )
    if with_draft and not stopped:
        state = _insert_context(params, cfg, state, meta, aux.pop("main_hidden"))
    return _pin(state, mesh, rules), (_replicated(logits, mesh), _replicated(aux, mesh))


def _insert_context(params, cfg, state, meta, main_hidden):
    """DSpark context insertion (spec 7.3) of a chunk's valid positions: main_x into every stage's ring."""
    mx = dspark_lib.main_x(params, cfg, main_hidden)
    return dspark_lib.insert_into_state(params, cfg, state, meta, mx)


def _sample(logits, positions, sampling: SamplingBatch, options: RunOptions):
    return sample(
        logits, positions, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
        sampling.token_bitmask, num_logprobs=options.max_logprobs,
    )  # fmt: skip


def decode(params, state, batch: StepBatch, *, options: RunOptions, cfg, mesh, rules):
    """One token per row (batch.tokens i32 [B]; rows with lens 0 are idle and write nothing), then the
    sampler under each row's token mask (i32 [B, W], all ones = unconstrained): (new state, (token [B],
    logprob [B], top ids [B, K], top logprobs [B, K]))."""
    meta = batch.meta
    logits, state, _ = forward(
        params,
        cfg,
        batch.tokens[:, None],
        state,
        meta,
        batch.engram,
        impl=options.impl,
        layout=sharding.make_layout(mesh, rules),
    )
    out = _sample(logits[:, 0], meta.start + 1, batch.sampling, options)
    return _pin(state, mesh, rules), _replicated(out, mesh)


def replay_tokens(cfg: ModelConfig, page_size: int, *, with_draft: bool = False) -> int:
    """Tokens a prefix-cache hit at a page boundary b replays before b (encoder SWA bounded replay,
    spec 4.2, made exact): prefilling [b - H, b) again with window_floor b - H and write_from b
    rebuilds every per-slot buffer as a cold run left it at b, while the pages before b (the cached
    compressed KV) stay as they are.

    Why L * (W - 1): layer l's SWA query at p reads layer l's keys at p - W + 1 .. p, made from layer
    l's input there. The rings at b must hold the keys of b - W + 1 .. b - 1 for every layer, so the
    top layer's input must be exact from b - W + 1, the layer below's from b - 2 (W - 1), ..., and the
    embeddings (exact wherever the replay starts) from b - L (W - 1). Nothing else reaches across
    positions except through the pages (exact), the Engram history (token ids, given with the replay;
    like the keys masked before the replay, it only touches the replay's first positions, which lie
    outside b's receptive field by the same count) and the compressor's partial group, which is empty
    at a page boundary (page_size is a multiple of every compress ratio, so no group straddles b). A
    CED prompt needs no more: its decoder layers' keys before decoder_from are masked in the cold run
    and the replay alike. DSpark's context rings hold the W positions before b of the target layers'
    inputs (`dspark_target_layer_ids`; every ring slot is read), so the deepest target t needs
    t (W - 1) + W. Rounded up to whole pages, so the replay's pages are the cold run's (a page's
    numerics depend on where the ring/chunk split of its window falls). A bound from the
    dependencies: a shorter replay may happen to give the same bits (a perturbation many layers
    away can round away), but nothing guarantees it."""
    window = cfg.sliding_window
    tokens = cfg.num_layers * (window - 1)
    if with_draft and cfg.dspark_target_layer_ids:
        tokens = max(tokens, max(cfg.dspark_target_layer_ids) * (window - 1) + window)
    return -(-tokens // page_size) * page_size


def floor_per_layer(cfg: ModelConfig, window_floor, decoder_from) -> np.ndarray:
    """i32 [R, L] `StepMetadata.window_floor` (on the host) of rows whose rings hold nothing before
    window_floor [R] and whose decoder layers (from `ModelConfig.ced_boundary`) nothing before
    decoder_from [R] either."""
    window_floor = np.asarray(window_floor, np.int32)
    floors = np.repeat(window_floor[:, None], cfg.num_layers, axis=1)
    boundary = cfg.ced_boundary_or_none
    if boundary is not None:
        floors[:, boundary:] = np.maximum(window_floor, np.asarray(decoder_from, np.int32))[:, None]
    return floors


def _loop_params(params, k):
    """params seen as values of loop iteration k. The forward dequantises every dense weight to f32
    from the parameters alone, so XLA's loop-invariant code motion would hoist all of those copies out
    of a page loop and keep them live through it (v41-flash: 30.8 GiB per device at expert=8, measured
    by `ced-jax plan --compile`); tied to the loop counter through a barrier, each is made inside the
    iteration where its layer runs and freed after it, as in a decode step. The barrier is an identity:
    the numbers do not change (tests/serving/test_compile_proof.py measures the memory)."""
    params, _ = jax.lax.optimization_barrier((params, k))
    return params


def _take_tokens(a, offset, width):
    """a [R, C, ...] -> a[r, offset[r] : offset[r] + width] for every row (clipped at the end)."""
    if a is None:
        return None
    idx = jnp.clip(offset[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], 0, a.shape[1] - 1)
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def prefill_batch(params, state, batch: StepBatch, *, options: RunOptions, cfg, mesh, rules, with_draft):
    """Prefill R rows at once: row r is a chunk batch.tokens[r] (i32 [R, C], C a multiple of
    page_size, meta.lens[r] valid, 0 for an idle row) of slot meta.slots[r] (distinct) starting at
    meta.start[r] (page aligned) through meta.page_tables[r]. `options.step_tokens` of every row per
    loop iteration (`forward` on [R, step_tokens]; None: a page; a multiple of page_size dividing C);
    a row whose chunk has no tokens in that step brings 0 tokens and writes nothing. `forward`
    computes a token the same way whatever the step's width and start
    (tests/ced_jax/test_invariance.py), so the width is a speed choice: a page for many short chunks,
    wide steps for one long prompt.

    CED prefill (spec 4.2) per row: meta.decoder_from [R] is the position from which the row runs
    every layer; its tokens before it (the prompt but its last window) run only the encoder pass (the
    blocks below `cfg.ced_boundary` and that layer's compressed-KV projection, `forward`'s
    stop_at_layer), in a first loop over their pages; then a second loop runs every layer over the
    rest, its decoder layers' SWA seeing no key before decoder_from (meta.window_floor [R, L],
    `floor_per_layer`). decoder_from <= start: the exact prefill (only the second loop does work for
    that row). meta.write_from [R]: pages are written only for groups from it on (a replay over cached
    positions; else 0).

    Returns (new state, the sample after each row's chunk (rows with lens 0, or a chunk whose tokens
    all ran only the encoder pass: garbage)). batch.images: image spans, sliced per page like the
    tokens; None = the text program (a separate executable)."""
    meta, tokens, images = batch.meta, batch.tokens, batch.images
    start, n, slots, page_tables = meta.start, meta.lens, meta.slots, meta.page_tables
    floors, decoder_from, write_from = meta.window_floor, meta.decoder_from, meta.write_from
    token_types = None if images is None else images.token_types
    span_embeds = None if images is None else images.span_embeds
    impl, step_tokens = options.impl, options.step_tokens
    layout = sharding.make_layout(mesh, rules)
    w = state.page_size if step_tokens is None else step_tokens
    num_rows, width = tokens.shape
    if w % state.page_size or width % w:
        raise ValueError(
            f"step_tokens {w}: a multiple of the page size {state.page_size} dividing the chunk {width}"
        )
    steps = width // w
    boundary = cfg.ced_boundary_or_none
    # Tokens of each row that run the encoder pass only: [0, encoder_n) of its chunk.
    encoder_n = jnp.clip(decoder_from - start, 0, n) if boundary is not None else jnp.zeros_like(n)

    def piece(offset, lens):
        """The metadata and inputs of the chunk tokens [offset, offset + lens) of every row."""
        meta = StepMetadata(
            start=jnp.where(lens > 0, start + offset, start), lens=lens, slots=slots,
            page_tables=page_tables, window_floor=floors, write_from=write_from,
        )  # fmt: skip
        take = lambda a: _take_tokens(a, offset, w)
        return meta, take(tokens), jax.tree.map(take, batch.engram), take(token_types), take(span_embeds)

    def encoder_body(carry):
        k, state = carry
        offset = jnp.broadcast_to(k * w, start.shape).astype(jnp.int32)
        meta, page_tokens, page_rows, page_types, page_spans = piece(
            offset, jnp.clip(encoder_n - k * w, 0, w)
        )
        _, state, _ = forward(
            _loop_params(params, k), cfg, page_tokens, state, meta, page_rows, token_types=page_types,
            span_embeds=page_spans, impl=impl, layout=layout, stop_at_layer=boundary,
        )  # fmt: skip
        return k + 1, state

    if boundary is not None:
        _, state = jax.lax.while_loop(
            lambda c: c[0] * w < jnp.max(encoder_n), encoder_body, (jnp.int32(0), state)
        )

    def body(carry):
        k, state, last = carry
        # Row r's tokens of step k that run every layer: [offset, offset + lens) of its chunk.
        offset = jnp.maximum(k * w, encoder_n)
        lens = jnp.clip(jnp.minimum((k + 1) * w, n) - offset, 0, w)
        meta, page_tokens, page_rows, page_types, page_spans = piece(offset, lens)
        params_k = _loop_params(params, k)
        logits, state, aux = forward(
            params_k, cfg, page_tokens, state, meta, page_rows, token_types=page_types,
            span_embeds=page_spans, capture_main_hidden=with_draft, impl=impl, layout=layout,
        )  # fmt: skip
        if with_draft:
            state = _insert_context(params_k, cfg, state, meta, aux["main_hidden"])
        i = n - 1 - offset  # each row's last token, if it is in this step
        here = (lens > 0) & (i >= 0) & (i < lens)
        picked = jnp.take_along_axis(logits, jnp.clip(i, 0, w - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(here[:, None], picked, last)
        return k + 1, state, last

    last = jnp.zeros((num_rows, cfg.vocab_size), jnp.float32)
    # The first page any row runs through every layer (rows of a CED prompt skip their encoder-only pages).
    busy = n > encoder_n
    first = jnp.min(jnp.where(busy, encoder_n // w, steps)).astype(jnp.int32)
    _, state, last = jax.lax.while_loop(
        lambda c: c[0] * w < jnp.max(jnp.where(busy, n, 0)), body, (first, state, last)
    )
    out = _sample(last, start + n, batch.sampling, options)
    return _pin(state, mesh, rules), _replicated(out, mesh)


def speculative_decode(params, state, batch: StepBatch, *, options: RunOptions, cfg, mesh, rules):
    """One speculative decode step (spec 7.3; the loop is ours). Row b's chunk batch.tokens[b] (i32
    [B, K+1]) is its last emitted token (position meta.start[b]) then its K drafts from the previous
    step, of which meta.lens[b] - 1 are verified (lens 0: an idle row). The target runs once over the
    chunk; `ced_jax.sampling.speculative_sample` accepts a prefix of the drafts and samples the token
    after it; the state keeps only the input token and the accepted drafts
    (`PagedCache.keep_accepted`: rejected positions' SWA and compressor writes undone, their page
    entries left past the row's length); their main_x goes into the stages' rings; then the stages
    draft the next block from the token just sampled. sampling.token_bitmask i32 [B, K+1, W]: mask j
    for the token after j accepted drafts. Returns (new state, (accepted [B], tokens [B, K+1], logprob
    [B, K+1], top ids, top logprobs, next drafts [B, block], next confidence [B, block]))."""
    meta, tokens, sampling, impl = batch.meta, batch.tokens, batch.sampling, options.impl
    temperature, top_p, top_k, seed = sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed
    layout = sharding.make_layout(mesh, rules)
    before = state
    width = tokens.shape[1] - 1
    logits, state, aux = forward(
        params, cfg, tokens, state, meta, batch.engram, capture_main_hidden=True,
        capture_chunk_state=True, impl=impl, layout=layout,
    )  # fmt: skip
    n_drafts = jnp.maximum(meta.lens - 1, 0)
    draft_filtered = state.draft_logits["q"][meta.slots][:, :width]
    accepted, emitted, logp, top_ids, top_logp = speculative_sample(
        logits, draft_filtered, tokens[:, 1:], n_drafts, meta.start, temperature, top_p, top_k, seed,
        sampling.token_bitmask, num_logprobs=options.max_logprobs,
    )  # fmt: skip
    live = meta.lens > 0
    kept = jnp.where(live, accepted + 1, 0)
    state = state.keep_accepted(before, meta, aux["chunk_state"], kept)
    kept_meta = dataclasses.replace(meta, lens=kept)
    state = _insert_context(params, cfg, state, kept_meta, aux["main_hidden"])
    next_input = jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
    rings = [state.draft_window[str(k)][meta.slots] for k in range(cfg.num_nextn_predict_layers)]
    drafts = dspark_lib.draft(
        params, cfg, params["embed"]["weight"], params["head"]["weight"], rings, next_input,
        meta.start + accepted, temperature, top_p, top_k, seed,
    )  # fmt: skip
    state = state.write_draft_logits(meta.slots, live, drafts.filtered_logits)
    out = (accepted, emitted, logp, top_ids, top_logp, drafts.tokens, drafts.confidence)
    return _pin(state, mesh, rules), _replicated(out, mesh)


def write_pages(state, pages, contents, *, mesh, rules):
    """`page_io.write_pages` with the state's layout pinned (pages past num_pages are dropped: padding)."""
    return _pin(page_io.write_pages(state, pages, contents), mesh, rules)


class Programs:
    """The jitted programs of one model (see the module docstring): each is
    `program(params, state, batch, options=RunOptions(...)) -> (state, out)`, the state donated, the
    options static (one executable per value)."""

    def __init__(self, cfg: ModelConfig, *, mesh=None, rules=None, with_draft: bool = False):
        """with_draft: the programs of a speculative engine (prefill and step insert DSpark context;
        `speculative_decode` exists); the model must carry the stages (params['mtp'])."""
        static = dict(cfg=cfg, mesh=mesh, rules=rules)
        jit = lambda fn: jax.jit(fn, static_argnames=("options",), donate_argnames=("state",))  # noqa: E731
        self.with_draft = with_draft
        self.step = jit(partial(step, **static, with_draft=with_draft))
        self.decode = jit(partial(decode, **static))
        self.prefill_batch = jit(partial(prefill_batch, **static, with_draft=with_draft))
        self.speculative_decode = jit(partial(speculative_decode, **static)) if with_draft else None
        self.read_pages = jax.jit(page_io.read_pages)
        self.write_pages = jax.jit(partial(write_pages, mesh=mesh, rules=rules), donate_argnames=("state",))

    @classmethod
    def shared(cls, cfg: ModelConfig, *, mesh=None, rules=None, with_draft: bool = False) -> Programs:
        """The `Programs` for these static choices while any model holds them: a second model of the
        same config reuses the compiled executables instead of tracing and compiling again. Held
        weakly, so the executables go with the last model (a long-lived process that loads many
        configs, a test session, must not keep every one). The parameters and state are arguments,
        so their shapes, dtypes and weight layout still pick the executable."""
        frozen_rules = None if rules is None else tuple(sorted((k, repr(v)) for k, v in rules.items()))
        key = (cfg, mesh, frozen_rules, with_draft)
        with _SHARED_LOCK:
            programs = _SHARED.get(key)
            if programs is None:
                programs = _SHARED[key] = cls(cfg, mesh=mesh, rules=rules, with_draft=with_draft)
        return programs


_SHARED: weakref.WeakValueDictionary[tuple, Programs] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()
