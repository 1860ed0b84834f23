"""The engine's device state: the paged KV cache in the packed deployment formats, immutable.

`PagedCache` is the only cache layout. It holds compressed entries in static-shape page buffers and
per slot the SWA rings and compressor partial groups; a call's rows are described by a `StepMetadata`
(start, lens, slots, page tables). Its methods (`write_window`, `compressor_state`,
`write_compressor_state`, `write_entries`, `entries`, `keep_accepted`) return a new cache and never
change the one they are called on; the attention kernels read the rings and pages directly
(`ced_jax.model.layers.kernels.KeySegment`).

Packed formats (spec 2.4), sizes derived from the config's head dims:
- FP4 main entry, `main_entry_bytes(D)` = D/2 + D/16 (288 B for D = 512): D e2m1 codes two per byte
  (even index in the low nibble), then D/16 e4m3 scales (one per 16 values).
- FP4 index key, `index_key_bytes(Dk)` = Dk/2 + Dk/32 (68 B for Dk = 128): e2m1 codes as above, then
  Dk/32 ue8m0 scale bytes (one per 32).
- FP8 SWA entry, `swa_entry_bytes(D)` = D + D/32 (528 B for D = 512): D e4m3 bytes, then D/32 ue8m0.
`pack_*` takes values produced by the matching fake quantiser (`ced_jax.quant`) and `unpack_*` gives
them back bit for bit; other values are rounded. The scale `pack_*` stores need not be the one the
quantiser used (a block whose largest code is below the maximum admits several), only one that
represents every value of the block exactly; the tests check the round trip, not the bytes.

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
import ml_dtypes
import numpy as np

from ced_jax.config import ModelConfig
from ced_jax.quant import FP4_TABLE, e2m1_codes_scaled, exact_div, round_e4m3

# ------------------------------------------------------------------------------------ sizes


def main_entry_bytes(head_dim: int) -> int:
    return head_dim // 2 + head_dim // 16


def index_key_bytes(index_head_dim: int) -> int:
    return index_head_dim // 2 + index_head_dim // 32


def swa_entry_bytes(head_dim: int) -> int:
    return head_dim + head_dim // 32


# ----------------------------------------------------------------------------- bit helpers
# e4m3fn byte -> value, built once on the host (ml_dtypes is the authority on the encoding).
_E4M3_DECODE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_E4M3_DECODE[np.isnan(_E4M3_DECODE)] = 0.0  # 0x7f/0xff are NaN; never produced by pack


def _e4m3_bytes(x: jax.Array) -> jax.Array:
    """f32 values exactly representable in e4m3fn -> their bytes (the convert is exact)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


def _e4m3_values(b: jax.Array) -> jax.Array:
    return jnp.asarray(_E4M3_DECODE)[b.astype(jnp.int32)]


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., K] -> [..., K/2], even index in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_fp4_values(packed: jax.Array) -> jax.Array:
    table = jnp.asarray(FP4_TABLE)
    lo = table[(packed & 0x0F).astype(jnp.int32)]
    hi = table[(packed >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _smallest_pow2_exponent(amax: jax.Array, max_mantissa_bits: int, max_exp: int) -> jax.Array:
    """Smallest integer e with amax <= M * 2^e, M = (1 + m/2^23) * 2^max_exp the format's largest
    value, by exponent/mantissa bits (exact: a float product could round across a power of two).

    amax is f32 >= 0; returns int32 (0 for amax == 0)."""
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    e = exponent - max_exp + (mantissa > max_mantissa_bits).astype(jnp.int32)
    return jnp.where(amax > 0, e, 0)


def _pow2(e: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


# ------------------------------------------------------------------------------- FP4 main


def pack_fp4_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """Fake-quantised FP4 values (`fp4_fake_quant_e4m3`) [..., D] -> uint8 [..., D/2 + D/block].

    A block's values are c_i * s with e2m1 codes c_i and an e4m3 scale s; the largest |c_i| is one
    of the e2m1 magnitudes, so s is amax / c for some c. Try c from 6 down and keep the first scale
    that is e4m3 and reproduces every value (the quantiser's own scale is always among them)."""
    xb = _blocks(x.astype(jnp.float32), block)  # [..., n, block]
    amax = jnp.max(jnp.abs(xb), axis=-1)  # [..., n]
    table = jnp.asarray(FP4_TABLE)
    chosen = jnp.ones_like(amax)  # all-zero blocks: any scale, codes 0
    found = amax == 0
    for c in (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5):
        s = exact_div(amax, c)
        codes = e2m1_codes_scaled(xb, s)
        exact = jnp.all(table[codes.astype(jnp.int32)] * s[..., None] == xb, axis=-1)
        ok = (round_e4m3(s) == s) & (s > 0) & exact & ~found
        chosen = jnp.where(ok, s, chosen)
        found = found | ok
    codes = e2m1_codes_scaled(xb, chosen).reshape(x.shape)
    return jnp.concatenate([_pack_nibbles(codes), _e4m3_bytes(chosen)], axis=-1)


def unpack_fp4_e4m3(packed: jax.Array, dim: int, block: int = 16) -> jax.Array:
    """uint8 [..., D/2 + D/block] -> f32 [..., D]."""
    values = _blocks(_unpack_fp4_values(packed[..., : dim // 2]), block)
    scale = _e4m3_values(packed[..., dim // 2 :])
    return (values * scale[..., None]).reshape(*packed.shape[:-1], dim)


# ------------------------------------------------------------------------ FP4 index keys


def pack_fp4_ue8m0(x: jax.Array, block: int = 32) -> jax.Array:
    """Fake-quantised FP4 values with power-of-two scales (`fp4_fake_quant_ue8m0`) [..., D] ->
    uint8 [..., D/2 + D/block].

    The stored scale is the smallest power of two with amax / s <= 6: the quantiser's scale is a
    power of two at least that large, and an e2m1 value times 2^k stays e2m1 while it is <= 6."""
    xb = _blocks(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    e = _smallest_pow2_exponent(amax, 0x400000, 2)  # 6 = 1.5 * 2^2
    codes = e2m1_codes_scaled(xb, _pow2(e)).reshape(x.shape)
    return jnp.concatenate([_pack_nibbles(codes), (e + 127).astype(jnp.uint8)], axis=-1)


def unpack_fp4_ue8m0(packed: jax.Array, dim: int, block: int = 32) -> jax.Array:
    values = _blocks(_unpack_fp4_values(packed[..., : dim // 2]), block)
    scale = _pow2(packed[..., dim // 2 :].astype(jnp.int32) - 127)
    return (values * scale[..., None]).reshape(*packed.shape[:-1], dim)


# ------------------------------------------------------------------------------- FP8 SWA


def pack_fp8_ue8m0(x: jax.Array, block: int = 32) -> jax.Array:
    """Fake-quantised FP8 values (`fp8_fake_quant`) [..., D] -> uint8 [..., D + D/block].

    Scale: the smallest power of two with amax / s <= 448 (as for FP4 above, scaling an e4m3 value
    up by 2^k keeps it e4m3, subnormals included, while it stays <= 448). Signed zeros survive."""
    xb = _blocks(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    e = _smallest_pow2_exponent(amax, 0x600000, 8)  # 448 = 1.75 * 2^8
    q = xb * _pow2(-e)[..., None]  # exact: a power of two
    return jnp.concatenate([_e4m3_bytes(q).reshape(x.shape), (e + 127).astype(jnp.uint8)], axis=-1)


def unpack_fp8_ue8m0(packed: jax.Array, dim: int, block: int = 32) -> jax.Array:
    values = _blocks(_e4m3_values(packed[..., :dim]), block)
    scale = _pow2(packed[..., dim:].astype(jnp.int32) - 127)
    return (values * scale[..., None]).reshape(*packed.shape[:-1], dim)


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

    window      {layer: u8 [max_slots, W, swa_entry_bytes]}        packed FP8 SWA ring per slot
    kv          {source: u8 [num_pages, page_size / r, main_entry_bytes]}   FP4 main entries
    index_k     {source: u8 [num_pages, page_size / r, index_key_bytes]}    FP4 index keys
    state_kv    {source (r > 1): f32 [max_slots, r, D]}             compressor partial group
    state_score {source (r > 1): f32 [max_slots, r, D]}
    draft_window {DSpark stage: u8 [max_slots, W, swa_entry_bytes]}  context rings of the draft stages
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

    def entry_dim(self, kind: str) -> int:
        return self.head_dim if kind == "kv" else self.index_head_dim

    # ---- SWA rings
    def ring(self, layer: int) -> jax.Array:
        """The packed SWA rings of `layer`, u8 [max_slots, W, swa_entry_bytes] (slot = position % W),
        as they were before this call's tokens: what the attention kernels read through `slots`."""
        return self.window[str(layer)]

    def write_window(self, layer: int, meta: StepMetadata, packed: jax.Array) -> PagedCache:
        """The cache with the chunk's valid SWA entries, packed [B, T, swa_entry_bytes], in the rings."""
        key = str(layer)
        rings = self.window[key]
        new = ring_update(rings[meta.slots], packed, meta.start, meta.lens)
        return dataclasses.replace(self, window={**self.window, key: rings.at[meta.slots].set(new)})

    def write_draft_window(self, stage: int, meta: StepMetadata, packed: jax.Array) -> PagedCache:
        """The cache with a chunk's DSpark context entries, packed [B, T, swa_entry_bytes], in stage
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
        return _ENTRY_FORMATS[kind][1](rows, self.entry_dim(kind))

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
_ENTRY_FORMATS = {"kv": (pack_fp4_e4m3, unpack_fp4_e4m3), "index_k": (pack_fp4_ue8m0, unpack_fp4_ue8m0)}


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
    swa = swa_entry_bytes(hd)
    window = {str(i): jnp.zeros((max_slots, W, swa), jnp.uint8) for i in range(cfg.num_layers)}
    kv, index_k, state_kv, state_score = {}, {}, {}, {}
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        if page_size % r:
            raise ValueError(f"page_size {page_size} is not a multiple of layer {s}'s compress ratio {r}")
        kv[str(s)] = jnp.zeros((num_pages, page_size // r, main_entry_bytes(hd)), jnp.uint8)
        index_k[str(s)] = jnp.zeros((num_pages, page_size // r, index_key_bytes(dk)), jnp.uint8)
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
