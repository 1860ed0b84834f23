"""CSA2 attention: latent MQA over [own sliding window || selected shared compressed entries].

Letters: B batch, T tokens in this chunk, H heads, Dh head dim (K = V), W window, R compress
ratio, S compressed-cache capacity (max_len / R), I indexer heads, Dk indexer head dim, X top-k.

Phases differ only in metadata (`ced_jax.cache.StepMetadata`): every call gets `start` [B]
(position of the chunk's first token), `lens` [B] (valid tokens in the chunk; the rest is padding),
the rows' slots and page tables. Prefill, chunked prefill and decode (T = 1) are the same code. The
state is the immutable `ced_jax.cache.PagedCache`; the layer returns a new one:
- window ring per slot [W, Dh] (packed FP8): slot = position % W, FP8-fake-quantised K after RoPE;
- compressed KV [S, Dh] and index keys [S, Dk] of each KV-source layer in pages (packed FP4), entry
  j standing for tokens [j R, (j+1) R), rotated at position j R and FP4-fake-quantised;
- compressor partial groups [R, Dh] per slot (kv and score, f32) of each ratio>1 source.
The attention kernels read the window rings and the compressed pages where they live, through the
slots and page tables (`ced_jax.model.layers.kernels.KeySegment`); nothing is unpacked and repacked
on the way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ced_jax.cache import PagedCache, StepMetadata, ring_update
from ced_jax.config import ModelConfig
from ced_jax.invariant import max_axis, sum_axis
from ced_jax.model.layers import kernels
from ced_jax.model.layers.common import (
    apply_rope,
    bf16_linear,
    f32_linear,
    fp8_linear,
    grouped_linear,
    rms_norm,
    rope_inv_freq,
)
from ced_jax.options import REFERENCE, Impl, IndexKeys
from ced_jax.quant import exact_div, fp4_fake_quant_e4m3, fp4_fake_quant_ue8m0, fp8_fake_quant, round_bf16
from pallas_kernels import formats


def layer_inv_freq(cfg: ModelConfig, layer: int):
    """Compressed layers rotate at compress_rope_theta with YaRN; SWA-only layers at rope_theta."""
    if cfg.compress_ratios[layer] > 0:
        yarn = (cfg.rope_factor, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_original_max_position)
        return rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, yarn)
    return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)


def ring_positions(start: jax.Array, period: int) -> jax.Array:
    """Position held by each ring slot before this chunk is written (-ve: never written). [B, P]."""
    prev = (start - 1)[:, None]
    return prev - jnp.mod(prev - jnp.arange(period)[None, :], period)


def window_floor(meta: StepMetadata, layer: int) -> jax.Array:
    """i32 [B]: the first position whose SWA key `layer`'s ring holds for each row (0 without a floor;
    never below 0, so unwritten positions -1, -2, ... of a fresh ring stay masked)."""
    if meta.window_floor is None:
        return jnp.zeros_like(meta.start)
    return jnp.maximum(meta.window_floor[:, layer], 0)


def window_segments(
    cache: PagedCache,
    layer: int,
    packed_chunk: jax.Array,
    meta: StepMetadata,
    positions: jax.Array,
    window: int,
) -> list[kernels.KeySegment]:
    """Keys each query sees in its causal window, positions (p - W, p]: the slot's ring as it was
    before this call, then the chunk's own keys (packed like the ring, one transient page per row)."""
    ring = cache.ring(layer)  # [max_slots, W, bytes]: one page of W entries per slot
    period = ring.shape[1]
    b, t = positions.shape
    ring_pos = ring_positions(meta.start, period)  # [B, W]
    q = positions[:, :, None]
    floor = window_floor(meta, layer)[:, None, None]
    ring_valid = (ring_pos[:, None, :] >= floor) & (ring_pos[:, None, :] > q - window)
    chunk_pos = positions[:, None, :]
    chunk_valid = (
        (jnp.arange(t)[None, None, :] < meta.lens[:, None, None])
        & (chunk_pos <= q)
        & (chunk_pos > q - window)
        & (chunk_pos >= floor)
    )
    ring_ids = jnp.broadcast_to(jnp.arange(period, dtype=jnp.int32), (b, period))
    chunk_ids = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    own_page = jnp.arange(b, dtype=jnp.int32)[:, None]
    return [
        kernels.KeySegment(ring, meta.slots[:, None], ring_ids, ring_valid),
        kernels.KeySegment(packed_chunk, own_page, chunk_ids, chunk_valid),
    ]


def window_segment_by_position(
    cache: PagedCache,
    layer: int,
    packed_chunk: jax.Array,
    meta: StepMetadata,
    positions: jax.Array,
    window: int,
) -> list[kernels.KeySegment]:
    """The keys of `window_segments` as one segment of `window` entries per query in position order:
    entry j of the query at position p is position p - W + 1 + j, read from the chunk when this call
    brings it and from the slot's ring otherwise (one transient page per row: the row's ring, then
    the chunk). A query's window keys, their order and their summation grouping are then the same
    whether the earlier tokens came in this chunk or in earlier calls, so a chunk of K+1 tokens
    computes every position exactly as K+1 one-token steps (speculative verification); with
    `window_segments` the split between the ring and the chunk segments moves with the chunk length.
    For the reference path; the kernels read the ring and the chunk where they are."""
    ring = cache.ring(layer)  # [max_slots, W, bytes]
    period = ring.shape[1]
    b = positions.shape[0]
    pages = jnp.concatenate([ring[meta.slots], packed_chunk], axis=1)  # [B, period + T, bytes]
    start = meta.start[:, None, None]
    key_pos = positions[:, :, None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)  # [B, T, W]
    in_chunk = key_pos >= start
    ids = jnp.where(in_chunk, period + key_pos - start, jnp.mod(key_pos, period)).astype(jnp.int32)
    held = jnp.where(in_chunk, key_pos - start < meta.lens[:, None, None], key_pos >= start - period)
    own_page = jnp.arange(b, dtype=jnp.int32)[:, None]
    return [
        kernels.KeySegment(pages, own_page, ids, (key_pos >= window_floor(meta, layer)[:, None, None]) & held)
    ]


def compress(
    x: jax.Array, p: dict, state_kv, state_score, start: jax.Array, lens: jax.Array, ratio: int, eps: float
):
    """Pool each complete group of `ratio` tokens into one latent (pre-RoPE, bf16-rounded).

    Returns (latent [B, G, Dh], entry index [B, G], complete [B, G], kv [B, T, Dh], score [B, T, Dh]):
    kv and score are the chunk's per-token projections that go into the partial-group state
    (`ring_update(state, kv, start, lens)`; None for ratio 1). Ratio 1 is a plain projection; ratio > 1
    pools with a softmax gate in f32, the tokens of a group split across calls being carried in the
    partial-group state."""
    if ratio == 1:
        latent = rms_norm(bf16_linear(x, p["wkv"]["weight"]), p["norm"]["weight"], eps)
        groups = jnp.arange(x.shape[1])[None, :]
        return latent, start[:, None] + groups, groups < lens[:, None], None, None
    kv = f32_linear(x, p["wkv"]["weight"])
    score = f32_linear(x, p["wgate"]["weight"])
    t = x.shape[1]
    n_groups = t // ratio + 1
    offset = jnp.mod(start, ratio)[:, None]  # tokens of the current group already in the state
    e = jnp.arange(n_groups * ratio)[None, :]
    src = jnp.clip(jnp.where(e < offset, e, e - offset + ratio), 0, ratio + t - 1)[..., None]
    ext_kv = jnp.take_along_axis(jnp.concatenate([state_kv, kv], axis=1), src, axis=1)
    ext_score = jnp.take_along_axis(jnp.concatenate([state_score, score], axis=1), src, axis=1)
    ext_kv = ext_kv.reshape(x.shape[0], n_groups, ratio, -1)
    ext_score = ext_score.reshape(x.shape[0], n_groups, ratio, -1)
    # Explicit maxima and sums over the group (`ced_jax.quant`): a group's latent must not depend on
    # how many groups share the call.
    weights = jnp.exp(ext_score - max_axis(ext_score, 2)[:, :, None])
    weights = exact_div(weights, sum_axis(weights, 2)[:, :, None])
    pooled = sum_axis(ext_kv * weights, 2)
    latent = rms_norm(round_bf16(pooled), p["norm"]["weight"], eps)
    groups = jnp.arange(n_groups)[None, :]
    complete = (groups + 1) * ratio <= offset + lens[:, None]
    entry = start[:, None] // ratio + groups
    return latent, entry, complete, kv, score


def index_keys(latent: jax.Array, p: dict, entry_pos: jax.Array, inv_freq, eps: float) -> jax.Array:
    """Index keys from the pre-RoPE latent: RMSNorm(latent Wk^T), RoPE at j R, FP4 (ue8m0, 32)."""
    k = rms_norm(bf16_linear(latent, p["wk"]["weight"]), p["k_norm"]["weight"], eps)
    k = apply_rope(k, entry_pos, inv_freq)
    return fp4_fake_quant_ue8m0(k, 32)


def main_entries(latent: jax.Array, entry_pos: jax.Array, inv_freq) -> jax.Array:
    """Compressed main KV: RoPE at j R, then FP4 with e4m3 scales per 16."""
    return fp4_fake_quant_e4m3(apply_rope(latent, entry_pos, inv_freq), 16)


def index_scores(
    x,
    qr,
    p: dict,
    keys,
    positions,
    inv_freq,
    cfg: ModelConfig,
    ratio: int,
    *,
    key_source: IndexKeys,
    impl: Impl,
):
    """The indexer's bf16 score row per query: sum_h relu(qI_h . k_t) w_h, invisible entries -inf
    (entry j is visible to the token at position p when its group is complete, j < (p + 1) // R).

    Where the keys come from is chosen by key_source, explicitly (not by their shape):
    - "intended": keys = (key_pages u8 [P, E, Dk/2 + Dk/32], page_tables i32 [B, n]), the KV source's
      packed index keys where they live; `kernels.index_scores` reads them through the page tables under
      `impl` (impl="pallas..." runs the indexer kernel on the pages, nothing unpacked beforehand).
    - "reference": keys = f32 [B, S, Dk], what the released code's global index-K pointer names
      (`shared["index_k_ptr"]`: unpacked entries of whichever source published last, not a page
      buffer), scored by the XLA formula (`kernels.index_scores_unpacked`) for every impl.

    -> scores [B, T, S] (f32 holding bf16 values)."""
    q, w = index_queries(x, qr, p, positions, inv_freq, cfg, impl=impl)
    n_visible = ((positions + 1) // ratio).astype(jnp.int32)
    if key_source is IndexKeys.REFERENCE:
        return kernels.index_scores_unpacked(q, w, keys, n_visible)
    key_pages, page_tables = keys
    return kernels.index_scores(q, w, key_pages, page_tables, n_visible, impl=impl)


def index_queries(x, qr, p: dict, positions, inv_freq, cfg: ModelConfig, *, impl: Impl = REFERENCE):
    """The indexer's FP4-fake-quantised queries f32 [B, T, I, Dk] and bf16 head weights [B, T, I]
    (softmax scale folded in)."""
    n_heads, dk = cfg.index_n_heads, cfg.index_head_dim
    q = fp8_linear(qr, p["wq_b"], impl=impl)
    q = q.reshape(*q.shape[:-1], n_heads, dk)
    q = apply_rope(q, positions[..., None], inv_freq)
    q = fp4_fake_quant_ue8m0(q, 32)
    w = round_bf16(bf16_linear(x, p["weights_proj"]["weight"]) * (dk**-0.5 * n_heads**-0.5))
    return q, w


def candidate_pool(
    scores: jax.Array, positions: jax.Array, ratio: int, top_blocks: int, block: int
) -> jax.Array:
    """Level one of the two-level top-k: the best `top_blocks` blocks of `block` entries (by their
    best score), the block of the newest visible entry always kept. Returns (a bool mask [B, T, S] of
    their entries, (block ids i32 [B, T, n] ascending, kept bool [B, T, n])): the mask for scores of
    the whole row, the ids for scoring only the pool (`candidate_entries`)."""
    width = scores.shape[-1]
    pad = -width % block
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(*scores.shape[:-1], -1, block), axis=-1)
    n_blocks = block_scores.shape[-1]
    newest = ((positions + 1) // ratio - 1) // block
    block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
    values, ids = jax.lax.top_k(block_scores, min(top_blocks, n_blocks))
    keep = jnp.zeros(block_scores.shape, bool)
    keep = jnp.put_along_axis(keep, ids, values > -jnp.inf, axis=-1, inplace=False)
    order = jnp.argsort(ids, axis=-1)
    blocks = (jnp.take_along_axis(ids, order, -1), jnp.take_along_axis(values > -jnp.inf, order, -1))
    return jnp.repeat(keep, block, axis=-1)[..., :width], blocks


def candidate_entries(blocks, positions: jax.Array, ratio: int, block: int) -> tuple[jax.Array, jax.Array]:
    """The entries of a candidate pool's blocks (`candidate_pool`), ascending: ids i32 [B, T, n *
    block] and valid bool (a kept block's entry visible to the query)."""
    ids, kept = blocks
    entries = (ids[..., None] * block + jnp.arange(block)).reshape(*ids.shape[:-1], -1).astype(jnp.int32)
    visible = entries < ((positions + 1) // ratio)[..., None]
    return entries, jnp.repeat(kept, block, axis=-1) & visible


def select_topk(
    scores: jax.Array,
    positions: jax.Array,
    ratio: int,
    top_k: int,
    entries: jax.Array | None = None,
    width: int | None = None,
) -> jax.Array:
    """Top-k entries by score (lower index first on ties), ascending, -1 = none. [B, T, X].

    entries None: scores [B, T, S] is the whole row (slot j = entry j). Else scores [B, T, C] are of
    the entries `entries` i32 [B, T, C] (ascending, -inf for the others) out of a row of `width`: the
    same selection as of the whole row with -inf everywhere else (k = min(top_k, width) either way;
    ascending entries keep the lower-index-first tie rule)."""
    if entries is None:
        k = min(top_k, scores.shape[-1])
        values, ids = jax.lax.top_k(scores, k)
    else:
        k = min(top_k, width)
        short = k - scores.shape[-1]
        if short > 0:  # fewer candidates than k: the rest are -inf, as in the whole row
            pad = ((0, 0), (0, 0), (0, short))
            scores = jnp.pad(scores, pad, constant_values=-jnp.inf)
            entries = jnp.pad(entries, pad, constant_values=width)
        values, picked = jax.lax.top_k(scores, k)
        ids = jnp.take_along_axis(entries, picked, axis=-1)
    valid = (values > -jnp.inf) & (ids < ((positions + 1) // ratio)[..., None])
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(valid, ids, big), axis=-1)
    return jnp.where(ordered == big, -1, ordered).astype(jnp.int32)


def _pool_entries(
    cfg: ModelConfig, layer: int, shared: dict, keys, positions, ratio: int, key_source: IndexKeys, impl: Impl
):
    """For a Reindex layer whose candidate pool is smaller than its row, (entry ids, valid) of the
    pool (`candidate_entries`) to score alone; else None (score the row, then mask it). Only the
    reference scoring of paged keys: the Pallas indexer kernels score whole rows through the page
    tables, and the reference index-K mode's keys are not pages."""
    reference = not impl.pallas
    if not cfg.uses_candidates(layer) or key_source is not IndexKeys.INTENDED or not reference:
        return None
    key_pages, page_tables = keys
    row = page_tables.shape[1] * key_pages.shape[1]
    ids, _ = shared["candidate_blocks"]
    if positions.shape[1] * ids.shape[-1] * cfg.candidate_block_size >= row:
        return None
    return candidate_entries(shared["candidate_blocks"], positions, ratio, cfg.candidate_block_size)


def write_compressed_kv(
    p: dict,
    cfg: ModelConfig,
    layer: int,
    x: jax.Array,
    meta: StepMetadata,
    cache: PagedCache,
    shared: dict,
    *,
    key_source: IndexKeys,
):
    """A KV-source layer's compressor: pool the chunk's complete groups (partial groups carried in
    the slot's state) into main entries and index keys and write them into the pages. x: the layer's
    attn_norm output [B, T, D]. This is all later tokens read from the layer, so CED prefill's encoder
    pass runs only this part of the first decoder layer (`ced_jax.model.forward`, stop_at_layer).
    Returns (new cache, new shared); `shared` as in `attention` (the chunk's partial-group values go
    to shared['chunk_state'], and for the reference index-K mode the pointer moves)."""
    eps = cfg.rms_norm_eps
    inv_freq = layer_inv_freq(cfg, layer)
    ratio = cfg.compress_ratios[layer]
    shared = dict(shared)
    chunk_state = shared.setdefault("chunk_state", {"window": {}, "compressor": {}})
    state_kv, state_score = cache.compressor_state(layer, meta)
    latent, entry, complete, chunk_kv, chunk_score = compress(
        x, p["compressor"], state_kv, state_score, meta.start, meta.lens, ratio, eps
    )
    if ratio > 1:
        skv = ring_update(state_kv, chunk_kv, meta.start, meta.lens)
        ssc = ring_update(state_score, chunk_score, meta.start, meta.lens)
        cache = cache.write_compressor_state(layer, meta, skv, ssc)
        chunk_state["compressor"][str(layer)] = (chunk_kv, chunk_score)
    entry_pos = entry * ratio
    published = jnp.any(complete, axis=1)  # [B]: did this owner produce an entry in this call
    if meta.write_from is not None:
        # A replay over cached positions: those entries are in the pages already.
        complete = complete & (entry_pos >= meta.write_from[:, None])
    # Index keys come from the latent before it is rotated and quantised for the main cache.
    keys = index_keys(latent, p["indexer"], entry_pos, inv_freq, eps)
    cache = cache.write_entries("index_k", layer, meta, keys, entry, complete)
    cache = cache.write_entries("kv", layer, meta, main_entries(latent, entry_pos, inv_freq), entry, complete)
    if key_source is IndexKeys.REFERENCE:
        # The released code moves its global index-K pointer only when an owner publishes.
        ptr = shared["index_k_ptr"]
        own = cache.entries("index_k", layer, meta)
        own = jnp.pad(own, ((0, 0), (0, ptr.shape[1] - own.shape[1]), (0, 0)))
        shared["index_k_ptr"] = jnp.where(published[:, None, None], own, ptr)
    return cache, shared


def attention(
    p: dict,
    cfg: ModelConfig,
    layer: int,
    x: jax.Array,
    meta: StepMetadata,
    cache: PagedCache,
    shared: dict,
    *,
    forced_topk: jax.Array | None,
    key_source: IndexKeys,
    impl: Impl,
):
    """One attention sublayer. x: attn_norm output [B, T, D].

    Returns (out [B, T, D], own top-k or None, new cache, new shared). `shared` carries what layers
    hand down: 'topk' [B, T, X], 'candidates' [B, T, S], and for the reference index-K mode
    'index_k_ptr' (the entries the released code's global pointer names). Nothing is changed in place."""
    eps = cfg.rms_norm_eps
    inv_freq = layer_inv_freq(cfg, layer)
    ratio = cfg.compress_ratios[layer]
    n_heads, head_dim = cfg.num_heads, cfg.head_dim
    positions = meta.positions(x.shape[1])
    shared = dict(shared)

    qr = rms_norm(fp8_linear(x, p["wq_a"], impl=impl), p["q_norm"]["weight"], eps)
    q = fp8_linear(qr, p["wq_b"], impl=impl).reshape(*x.shape[:-1], n_heads, head_dim)
    q = apply_rope(q, positions[..., None], inv_freq)

    kv = rms_norm(fp8_linear(x, p["wkv"], impl=impl), p["kv_norm"]["weight"], eps)
    kv = fp8_fake_quant(apply_rope(kv, positions, inv_freq), 32)
    packed_kv = formats.pack_fp8_entries(kv)
    by_position = not impl.pallas
    segments = (window_segment_by_position if by_position else window_segments)(
        cache, layer, packed_kv, meta, positions, cfg.sliding_window
    )
    cache = cache.write_window(layer, meta, packed_kv)
    # What this chunk put into the slot's per-slot buffers, for `PagedCache.keep_accepted` (speculative
    # verification keeps only a prefix of the chunk); unused values cost nothing under jit.
    chunk_state = shared.setdefault("chunk_state", {"window": {}, "compressor": {}})
    chunk_state["window"][str(layer)] = packed_kv

    own_topk = None
    if ratio > 0:
        src = cfg.kv_source_of(layer)
        if layer in cfg.kv_source_layer_ids:
            cache, shared = write_compressed_kv(p, cfg, layer, x, meta, cache, shared, key_source=key_source)
        if layer in cfg.index_source_layer_ids:
            if key_source is IndexKeys.REFERENCE:
                keys = shared["index_k_ptr"]
                cap = cache.capacity("index_k", src, meta)
                keys = (
                    keys[:, :cap]
                    if keys.shape[1] >= cap
                    else jnp.pad(keys, ((0, 0), (0, cap - keys.shape[1]), (0, 0)))
                )
            else:
                keys = (cache.index_k[str(src)], meta.page_tables)
            pool_entries = _pool_entries(cfg, layer, shared, keys, positions, ratio, key_source, impl)
            if pool_entries is not None:
                # A Reindex layer picks only inside the candidate pool: score just the pool's entries
                # (a fixed count) instead of the whole row (the context), with the same result.
                entries, valid = pool_entries
                index_q, index_w = index_queries(x, qr, p["indexer"], positions, inv_freq, cfg, impl=impl)
                scores = kernels.index_scores_at(index_q, index_w, *keys, entries, valid)
                width = keys[1].shape[1] * keys[0].shape[1]
                own_topk = select_topk(scores, positions, ratio, cfg.index_topk, entries, width)
            else:
                scores = index_scores(
                    x, qr, p["indexer"], keys, positions, inv_freq, cfg, ratio,
                    key_source=key_source, impl=impl,
                )  # fmt: skip
                if layer == cfg.candidate_source_layer_id:
                    shared["candidates"], shared["candidate_blocks"] = candidate_pool(
                        scores, positions, ratio, cfg.candidate_topk_blocks, cfg.candidate_block_size
                    )
                elif cfg.uses_candidates(layer):
                    scores = jnp.where(shared["candidates"], scores, -jnp.inf)
                own_topk = select_topk(scores, positions, ratio, cfg.index_topk)
            shared["topk"] = own_topk if forced_topk is None else forced_topk
        topk = shared["topk"]
        segments.append(
            kernels.KeySegment(cache.kv[str(src)], meta.page_tables, jnp.maximum(topk, 0), topk >= 0)
        )

    o = kernels.sparse_attention(q, segments, p["attn_sink"], head_dim**-0.5, impl=impl)
    o = apply_rope(o, positions[..., None], inv_freq, inverse=True)
    groups = cfg.o_groups
    o = o.reshape(*x.shape[:-1], groups, n_heads * head_dim // groups)
    wo_a = p["wo_a"]["weight"].astype(jnp.float32).reshape(groups, cfg.o_lora_rank, -1)
    o = round_bf16(grouped_linear(o, wo_a))
    out = fp8_linear(o.reshape(*x.shape[:-1], -1), p["wo_b"], impl=impl)
    return out, own_topk, cache, shared
