"""The engine's device state: the paged KV cache in the packed deployment formats, immutable.

`PagedCache` is the only cache layout. It holds compressed entries in static-shape page buffers and
per slot the SWA rings and compressor partial groups; a call's rows are described by a `StepMetadata`
(start, lens, slots, page tables). Its methods (`write_window`, `compressor_state`,
`write_compressor_state`, `write_entries`, `entries`, `keep_accepted`) return a new cache and never
change the one they are called on; the attention kernels read the rings and pages directly
(`ced_jax.model.layers.kernels.KeySegment`).

Entries are stored in the packed formats of spec 2.4, written and read by the one codec home,
`pallas_kernels.formats`: FP4 main entries (`fp4_entry_bytes`, 288 B for D = 512), FP4 index keys
(`index_key_bytes`, 68 B for Dk = 128) and FP8 SWA entries (`fp8_entry_bytes`, 528 B for D = 512).

Paged layout (`init_paged_cache`). A page holds `page_size` tokens; a ratio-r KV source stores
`page_size / r` entries per page (so page_size must be a multiple of every ratio), and entry j of a
row lives at `(page_tables[row, j // E], j % E)` with E entries per page. Per layer there is one
packed FP8 SWA ring per slot, and per ratio>1 source the f32 partial group (kv and score) per slot.
The metadata's `slots` maps the rows of the current call to slots, so `forward` runs unchanged on a
batch of any size (a decode bucket, one prefill page, a notebook session's rows). Reads never go past
what a row's positions make visible (the attention masks do that), so pages past a sequence may hold anything.
Global bytes per token (`kv_bytes_per_token`) count only the page buffers: 890 for v41-flash.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ced_jax.config import ModelConfig
from pallas_kernels import formats

# ------------------------------------------------------------------------------ ring helper


def ring_update(ring: jax.Array, new: jax.Array, start: jax.Array, lens: jax.Array) -> jax.Array:
    """Write the valid tokens of a chunk into a ring of period P = ring.shape[1] (slot = pos % P).

    ring [B, P, ...], new [B, T, ...]. Each slot takes the newest chunk token that maps to it."""
    period = ring.shape[1]
    slots = jnp.arange(period)[None, :]
    last = (start + lens - 1)[:, None]
    newest = last - jnp.mod(last - slots, period)  # newest position <= last with pos % P == slot
    take = newest >= start[:, None]
    idx = jnp.clip(newest - start[:, None], 0, new.shape[1] - 1)
    gathered = jnp.take_along_axis(new, idx.reshape(idx.shape + (1,) * (new.ndim - 2)), axis=1)
    take = take.reshape(take.shape + (1,) * (new.ndim - 2))
    return jnp.where(take, gathered, ring)


# ---------------------------------------------------------------------------- step metadata


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """What one call of `ced_jax.model.forward` does, for every phase (prefill chunks, decode, mixed):
    row b of the call is slot `slots[b]`, brings `lens[b]` tokens (0: an idle row, which writes
    nothing) starting at position `start[b]`, and addresses its compressed entries through
    `page_tables[b]`.

    start       i32 [B]   position of the row's first token
    lens        i32 [B]   valid tokens of the row (the rest of the chunk is padding)
    slots       i32 [B]   the slot (SWA ring, partial group) of each row; distinct within a call
    page_tables i32 [B, pages_per_slot]  physical page of each logical page of the row
    window_floor i32 [B, L] or None  per layer, the first position whose SWA key the row's window may
                hold: keys of earlier positions are absent (never computed for this sequence, so
                the ring slots hold anything) and masked out. Used where a layer's ring is rebuilt
                from a later position: CED prefill's decoder layers (bounded replay from the prompt's
                last window) and a prefix hit's replay. None: every position of the ring is valid.
    write_from  i32 [B] or None  compressed entries (pages) are written only for groups starting at
                or after this position: a replay over cached positions recomputes rings and partial
                groups and leaves the cached pages as they are. None: every complete group is written.
    decoder_from i32 [B] or None  a prefill's CED split: the row's tokens before it run only the
                encoder pass (`forward`'s stop_at_layer), the rest every layer; `forward` itself
                does not read it (window_floor already bounds the decoder layers' windows).
    """

    start: jax.Array
    lens: jax.Array
    slots: jax.Array
    page_tables: jax.Array
    window_floor: jax.Array | None = None
    write_from: jax.Array | None = None
    decoder_from: jax.Array | None = None

    def positions(self, tokens: int) -> jax.Array:
        """i32 [B, T]: the position of every token of a chunk of T tokens."""
        return self.start[:, None] + jnp.arange(tokens, dtype=jnp.int32)[None, :]


jax.tree_util.register_dataclass(
    StepMetadata,
    data_fields=["start", "lens", "slots", "page_tables", "window_floor", "write_from", "decoder_from"],
    meta_fields=[],
)


def contiguous_page_tables(rows: int, pages_per_row: int) -> np.ndarray:
    """i32 [rows, pages_per_row]: row b owns pages b * pages_per_row ... (a fixed batch of sequences
    that share nothing, as the notebook API runs)."""
    return np.arange(rows * pages_per_row, dtype=np.int32).reshape(rows, pages_per_row)


# ---------------------------------------------------------------------------- paged state


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """The engine's device state (see the module docstring): an immutable pytree whose methods return
    a new cache and never change this one. The buffers are leaves; `page_size` (tokens per page) and
    the entry widths are static. Which rows a call touches comes from its `StepMetadata`.

    window      {layer: u8 [max_slots, W, fp8_entry_bytes]}        packed FP8 SWA ring per slot
    kv          {source: u8 [num_pages, page_size / r, fp4_entry_bytes]}   FP4 main entries
    index_k     {source: u8 [num_pages, page_size / r, index_key_bytes]}    FP4 index keys
    state_kv    {source (r > 1): f32 [max_slots, r, D]}             compressor partial group
    state_score {source (r > 1): f32 [max_slots, r, D]}
    draft_window {DSpark stage: u8 [max_slots, W, fp8_entry_bytes]}  context rings of the draft stages
                (empty without DSpark; spec 7.3)
    draft_logits {"q": f32 [max_slots, block, V]}  each slot's last drafts' filtered draft logits, which
                the next speculative step's rejection sampling needs (empty without DSpark)
    """

    window: dict
    kv: dict
    index_k: dict
    state_kv: dict
    state_score: dict
    page_size: int
    head_dim: int
    index_head_dim: int
    draft_window: dict = dataclasses.field(default_factory=dict)
    draft_logits: dict = dataclasses.field(default_factory=dict)

    # ---- SWA rings
    def ring(self, layer: int) -> jax.Array:
        """The packed SWA rings of `layer`, u8 [max_slots, W, fp8_entry_bytes] (slot = position %
        W), as they were before this call's tokens: what the attention kernels read through `slots`."""
        return self.window[str(layer)]

    def write_window(self, layer: int, meta: StepMetadata, packed: jax.Array) -> PagedCache:
        """The cache with the chunk's valid SWA entries, packed [B, T, fp8_entry_bytes],
        in the rings."""
        key = str(layer)
        rings = self.window[key]
        new = ring_update(rings[meta.slots], packed, meta.start, meta.lens)
        return dataclasses.replace(self, window={**self.window, key: rings.at[meta.slots].set(new)})

    def write_draft_window(self, stage: int, meta: StepMetadata, packed: jax.Array) -> PagedCache:
        """The cache with a chunk's DSpark context entries, packed [B, T, fp8_entry_bytes], in stage
        `stage`'s rings (context insertion, spec 7.3)."""
        key = str(stage)
        rings = self.draft_window[key]
        new = ring_update(rings[meta.slots], packed, meta.start, meta.lens)
        return dataclasses.replace(
            self, draft_window={**self.draft_window, key: rings.at[meta.slots].set(new)}
        )

    def write_draft_logits(self, slots: jax.Array, live: jax.Array, q: jax.Array) -> PagedCache:
        """The cache with rows `live` [B] of q [B, block, V] stored as their slots' draft logits."""
        buf = self.draft_logits["q"]
        new = jnp.where(live[:, None, None], q, buf[slots])
        return dataclasses.replace(self, draft_logits={"q": buf.at[slots].set(new)})

    # ---- compressor partial groups
    def compressor_state(self, layer: int, meta: StepMetadata) -> tuple[jax.Array | None, jax.Array | None]:
        """The partial group (kv, score) f32 [B, r, D] of a ratio>1 source; (None, None) otherwise."""
        key = str(layer)
        if key not in self.state_kv:
            return None, None
        return self.state_kv[key][meta.slots], self.state_score[key][meta.slots]

    def write_compressor_state(
        self, layer: int, meta: StepMetadata, state_kv: jax.Array, state_score: jax.Array
    ) -> PagedCache:
        key = str(layer)
        return dataclasses.replace(
            self,
            state_kv={**self.state_kv, key: self.state_kv[key].at[meta.slots].set(state_kv)},
            state_score={**self.state_score, key: self.state_score[key].at[meta.slots].set(state_score)},
        )

    # ---- compressed entries
    def capacity(self, kind: str, layer: int, meta: StepMetadata) -> int:
        """Entries a row can hold (max_context / r)."""
        return meta.page_tables.shape[1] * getattr(self, kind)[str(layer)].shape[1]

    def write_entries(
        self,
        kind: str,
        layer: int,
        meta: StepMetadata,
        values: jax.Array,
        entry: jax.Array,
        complete: jax.Array,
    ) -> PagedCache:
        """The cache with values [B, G, d] (fake-quantised) stored as entries entry [B, G] of `layer`
        where complete (the rest dropped)."""
        key = str(layer)
        buf = getattr(self, kind)[key]  # [N, E, bytes]
        num_pages, per_page = buf.shape[:2]
        table = meta.page_tables
        ok = complete & (entry >= 0) & (entry < table.shape[1] * per_page)
        page = jnp.take_along_axis(table, jnp.clip(entry // per_page, 0, table.shape[1] - 1), axis=1)
        page = jnp.where(ok, page, num_pages)  # out of bounds -> dropped
        packed = _ENTRY_FORMATS[kind][0](values)
        new = buf.at[page, entry % per_page].set(packed, mode="drop")
        return dataclasses.replace(self, **{kind: {**getattr(self, kind), key: new}})

    def entries(self, kind: str, layer: int, meta: StepMetadata) -> jax.Array:
        """Every entry of each row, unpacked: f32 [B, S, d] (entries past what a row wrote hold anything)."""
        buf = getattr(self, kind)[str(layer)]
        rows = buf[meta.page_tables]  # [B, P, E, bytes]
        rows = rows.reshape(rows.shape[0], -1, rows.shape[-1])
        return _ENTRY_FORMATS[kind][1](rows)

    # ---- speculative verification
    def keep_accepted(
        self, before: PagedCache, meta: StepMetadata, chunk_state: dict, kept: jax.Array
    ) -> PagedCache:
        """After a chunk of meta.lens tokens was written by `forward`, the cache as if only the first
        `kept` [B] tokens of each row had been: every per-slot buffer the chunk changed (SWA rings,
        compressor partial groups) is rebuilt from `before` (the cache the chunk started from) and the
        chunk's own values (forward's aux['chunk_state']) with lens = kept. Page entries written for the
        dropped tokens stay: they lie past the row's new length, invisible to every read, and are
        rewritten when those positions are computed again."""
        kept_meta = dataclasses.replace(meta, lens=kept)
        cache = self
        for key, packed in chunk_state["window"].items():
            rings = before.window[key]
            new = ring_update(rings[meta.slots], packed, meta.start, kept)
            cache = dataclasses.replace(
                cache, window={**cache.window, key: cache.window[key].at[meta.slots].set(new)}
            )
        for key, (kv, score) in chunk_state["compressor"].items():
            layer = int(key)
            old_kv, old_score = before.compressor_state(layer, kept_meta)
            cache = cache.write_compressor_state(
                layer,
                kept_meta,
                ring_update(old_kv, kv, meta.start, kept),
                ring_update(old_score, score, meta.start, kept),
            )
        return cache


jax.tree_util.register_dataclass(
    PagedCache,
    data_fields=["window", "kv", "index_k", "state_kv", "state_score", "draft_window", "draft_logits"],
    meta_fields=["page_size", "head_dim", "index_head_dim"],
)

# kind -> (pack, unpack) of the compressed entries
_ENTRY_FORMATS = {
    "kv": (formats.pack_fp4_entries, formats.unpack_fp4_entries),
    "index_k": (formats.pack_index_keys, formats.unpack_index_keys),
}


def init_paged_cache(
    cfg: ModelConfig,
    *,
    max_slots: int,
    page_size: int,
    num_pages: int,
    draft_stages: int = 0,
    draft_vocab: int = 0,
    draft_block: int = 0,
) -> PagedCache:
    """Zeroed state (under `jax.eval_shape` this sizes it without allocating). draft_stages: DSpark
    stages whose context rings the state carries (0: none); draft_vocab / draft_block: the shape of
    each slot's stored draft logits (0: none)."""
    hd, dk, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    swa = formats.fp8_entry_bytes(hd)
    window = {str(i): jnp.zeros((max_slots, W, swa), jnp.uint8) for i in range(cfg.num_layers)}
    kv, index_k, state_kv, state_score = {}, {}, {}, {}
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        if page_size % r:
            raise ValueError(f"page_size {page_size} is not a multiple of layer {s}'s compress ratio {r}")
        kv[str(s)] = jnp.zeros((num_pages, page_size // r, formats.fp4_entry_bytes(hd)), jnp.uint8)
        index_k[str(s)] = jnp.zeros((num_pages, page_size // r, formats.index_key_bytes(dk)), jnp.uint8)
        if r > 1:
            state_kv[str(s)] = jnp.zeros((max_slots, r, hd), jnp.float32)
            state_score[str(s)] = jnp.zeros((max_slots, r, hd), jnp.float32)
    return PagedCache(
        window=window,
        kv=kv,
        index_k=index_k,
        state_kv=state_kv,
        state_score=state_score,
        page_size=page_size,
        head_dim=hd,
        index_head_dim=dk,
        draft_window={str(k): jnp.zeros((max_slots, W, swa), jnp.uint8) for k in range(draft_stages)},
        draft_logits=(
            {"q": jnp.zeros((max_slots, draft_block, draft_vocab), jnp.float32)}
            if draft_vocab and draft_block
            else {}
        ),
    )


def paged_cache_axes(cache: PagedCache) -> PagedCache:
    """The logical axes of every buffer (a PagedCache of axis tuples), for `ced_jax.sharding`.

    Per-slot state goes with the sequences ("batch"); the page buffers are split along the pool
    ("pages"). The shipped tables other than `dp_ep` replicate the pages: a prefix page may then serve
    sequences on any data shard. Under `dp_ep` each device holds the pages of its own slots (the
    allocator hands a slot pages from its device's block: `ced_jax.model.forward`)."""
    per_slot = lambda a: ("batch",) + (None,) * (a.ndim - 1)
    pool = lambda a: ("pages",) + (None,) * (a.ndim - 1)
    return PagedCache(
        window={k: per_slot(v) for k, v in cache.window.items()},
        kv={k: pool(v) for k, v in cache.kv.items()},
        index_k={k: pool(v) for k, v in cache.index_k.items()},
        state_kv={k: per_slot(v) for k, v in cache.state_kv.items()},
        state_score={k: per_slot(v) for k, v in cache.state_score.items()},
        draft_window={k: per_slot(v) for k, v in cache.draft_window.items()},
        draft_logits={k: per_slot(v) for k, v in cache.draft_logits.items()},
        page_size=cache.page_size,
        head_dim=cache.head_dim,
        index_head_dim=cache.index_head_dim,
    )


def _nbytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def buffer_bytes(tree) -> int:
    """Bytes held by the arrays (or ShapeDtypeStructs, under `jax.eval_shape`) of a pytree: a
    PagedCache, or one of its buffer dicts."""
    return sum(_nbytes(a) for a in jax.tree.leaves(tree))


def kv_bytes_per_token(cache: PagedCache) -> float:
    """Global compressed-KV bytes per token held by the page buffers (arrays or ShapeDtypeStructs):
    main entries plus index keys of every KV source, divided by the tokens the pages hold."""
    buffers = (*cache.kv.values(), *cache.index_k.values())
    if not buffers:
        return 0.0
    num_pages = buffers[0].shape[0]
    return sum(_nbytes(a) for a in buffers) / (num_pages * cache.page_size)
