"""The one seam between the model and its kernels. Selection is explicit (`impl=`); an
unsupported implementation or shape raises, there is never a silent fallback.

`impl` (`ced_jax.options.Impl`): the pure-jnp reference (the default on CPU and the parity target) or
the `pallas_kernels` kernels (the backend's own unless one is named, or in the HLO interpreter).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ced_jax.invariant import max_fenced, sum_last, sum_small
from ced_jax.options import REFERENCE, Impl
from ced_jax.quant import exact_div, expert_weight, round_bf16

# Key slots the reference indexer scores at a time (`index_scores`): a block's f32 keys stay in a
# CPU's cache (measured best at 4,096-8,192 slots, BENCHMARKS.md).
INDEX_SCORE_BLOCK = 8192


# Entries (row, expert) whose weights a decode step dequantises at once in `expert_matmul`.
EXPERT_DECODE_GROUP = 8


def _expert_pairs(rows: jax.Array, expert_ids: jax.Array, w: dict) -> jax.Array:
    """rows [M, K] times their experts' weights^T, gathered and dequantised together -> f32 [M, N]."""
    weight = expert_weight(w, expert_ids)  # [M, N, K]
    # Each row as a two-row product (the second row zero): a one-row product sums in another order
    # than the per-expert tiles of many rows (`ced_jax.invariant.matmul_rows`), and a token must get the
    # same expert outputs in a decode step and in a chunk.
    pair = jnp.stack([rows, jnp.zeros_like(rows)], axis=1)  # [M, 2, K]
    return jnp.einsum("mik,mnk->min", pair, weight, precision=jax.lax.Precision.HIGHEST)[:, 0]


def expert_matmul(rows: jax.Array, expert_ids: jax.Array, w: dict, *, impl: Impl = REFERENCE) -> jax.Array:
    """rows [M, K] (FP8-dequantised activations) times each row's expert weight^T -> f32 [M, N].

    w: {'weight': u8 packed FP4 [E, N, K/2], 'scale': u8 e8m0 [E, N, K/32]}, or {'weight': f32
    [E, N, K]} in the dequantised layout (`ced_jax.checkpoint.weight_layout`; not for the Pallas kernel).
    Few rows (decode) gather only the touched experts; many rows sort by expert and use
    `lax.ragged_dot` over the dequantised expert stack. Both compute the same products in f32.
    impl="pallas..." sorts the rows by expert and runs the FP4 grouped-matmul kernel, which
    dequantises the weights tile by tile inside the kernel; impl="cpu" runs the CPU kernel on the rows
    as they are (`pallas_kernels.grouped_matmul.kernel_cpu`: this path's values bit for bit)."""
    num_experts = w["weight"].shape[0]
    if impl.cpu:
        from pallas_kernels.grouped_matmul import kernel_cpu

        if "scale" not in w:
            raise ValueError(
                "impl='cpu': the FP4 expert kernel reads packed experts, and these are dequantised "
                "(weight_layout='f32'); load with weight_layout='f32-dense' or 'stored'"
            )
        ids = expert_ids.astype(jnp.int32)
        return kernel_cpu.expert_rows(rows.astype(jnp.float32), ids, w["weight"], w["scale"])
    if impl.pallas:
        from pallas_kernels.grouped_matmul import gmm

        if "scale" not in w:
            raise ValueError(
                "impl='pallas': the FP4 grouped-matmul kernel reads packed experts, and these are "
                "dequantised (weight_layout='f32'); load with weight_layout='f32-dense' or 'stored'"
            )
        order = jnp.argsort(expert_ids, stable=True)
        group_sizes = jnp.bincount(expert_ids, length=num_experts).astype(jnp.int32)
        out_sorted = gmm(
            rows[order].astype(jnp.float32),
            w["weight"],
            w["scale"],
            group_sizes,
            backend=impl.backend,
            interpret=impl.interpret,
        )
        return jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    m = rows.shape[0]
    if m < num_experts:
        if m <= EXPERT_DECODE_GROUP:
            return _expert_pairs(rows, expert_ids, w)
        # More entries than a group (a decode step of several rows): a loop over groups, so that
        # only one group's dequantised weights exist at a time (a cache-sized buffer instead of
        # [M, N, K] f32: the experts of a 48-entry mid step 1.8x faster, BENCHMARKS.md); the same products.
        groups = -(-m // EXPERT_DECODE_GROUP)
        pad = groups * EXPERT_DECODE_GROUP - m
        rows_g = jnp.pad(rows, ((0, pad), (0, 0))).reshape(groups, EXPERT_DECODE_GROUP, rows.shape[1])
        ids_g = jnp.pad(expert_ids, (0, pad)).reshape(groups, EXPERT_DECODE_GROUP)
        out = jax.lax.map(lambda g: _expert_pairs(g[0], g[1], w), (rows_g, ids_g))
        return out.reshape(groups * EXPERT_DECODE_GROUP, -1)[:m]
    order = jnp.argsort(expert_ids)
    group_sizes = jnp.bincount(expert_ids, length=num_experts).astype(jnp.int32)
    weight = expert_weight(w)  # [E, N, K]
    out_sorted = jax.lax.ragged_dot(
        rows[order], jnp.swapaxes(weight, 1, 2), group_sizes, precision=jax.lax.Precision.HIGHEST
    )
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)


class KeySegment(NamedTuple):
    """Keys of one part of a query's attention span, read where they live: packed entries addressed
    through page tables, exactly what the paged kernels take.

    pages       u8  [P, S, entry_bytes]  packed FP8 (SWA window, chunk) or FP4 (compressed) entries;
                                         the format is read off entry_bytes
    page_table  i32 [B, n]               physical page of each logical page of row b
    ids         i32 [B, N] (every query of the chunk sees the same entries, e.g. the window ring) or
                i32 [B, T, N] (entries chosen per query, e.g. the top-k): logical entry ids of row b
    valid       bool [B, T, N]           which of them query t attends to
    """

    pages: jax.Array
    page_table: jax.Array
    ids: jax.Array
    valid: jax.Array


def sparse_attention(
    q: jax.Array,
    segments: list[KeySegment],
    sink: jax.Array,
    scale: float,
    *,
    impl: Impl = REFERENCE,
) -> jax.Array:
    """Single-KV-head attention (V = K) over several key segments, with a per-head sink.

    q: [B, T, H, Dh] (bf16-exact f32). The sink adds exp(sink_h) to the denominator only;
    probabilities are rounded to bf16 before P.V (the reference's rounding point); a row with no
    valid key returns zeros. Output [B, T, H, Dh], rounded to bf16. Both implementations read the
    segments' pages through their page tables (`pallas_kernels.sparse_attention.common.resolve_rows`
    is the one place ids become physical rows); the reference unpacks only the entries it reads."""
    b, t = q.shape[:2]
    for i, seg in enumerate(segments):
        want = (b, t, seg.ids.shape[-1])
        if seg.ids.ndim not in (2, 3) or seg.valid.shape != want:
            raise ValueError(
                f"segment {i}: ids must be [B, N] or [B, T, N] and valid [B, T, N] = {list(want)}, "
                f"got ids {list(seg.ids.shape)}, valid {list(seg.valid.shape)}"
            )
    if impl.pallas:
        return _sparse_attention_pallas(q, segments, sink, scale, impl.backend, impl.interpret)
    from pallas_kernels import formats
    from pallas_kernels.sparse_attention.common import resolve_rows, segment_format

    dim = q.shape[-1]
    unpack = {"fp8": formats.unpack_fp8_entries, "fp4": formats.unpack_fp4_entries}
    scale = jnp.float32(scale)
    logits, keys_per_segment = [], []
    for seg in segments:
        rows = resolve_rows(seg.pages, seg.page_table, seg.ids)
        flat = seg.pages.reshape(-1, seg.pages.shape[-1])
        keys = unpack[segment_format(seg.pages.shape[-1], dim)](flat[jnp.maximum(rows, 0)])
        valid = seg.valid & (rows >= 0 if seg.ids.ndim == 3 else (rows >= 0)[:, None, :])
        # Entries no query of the row may read are zeroed, so garbage in unused pages cannot leak
        # into P.V as 0 * NaN (per-query entries by their validity, shared ones by their page).
        keys = jnp.where((valid if seg.ids.ndim == 3 else rows >= 0)[..., None], keys, 0.0)
        eq = "bthd,bsd->bths" if seg.ids.ndim == 2 else "bthd,btsd->bths"
        s = jnp.einsum(eq, q, keys, precision=jax.lax.Precision.HIGHEST) * scale
        logits.append(jnp.where(valid[:, :, None, :], s, -jnp.inf))
        keys_per_segment.append(keys)
    # A fenced reduce: the exp below must not join it in a YNNPACK fusion (`ced_jax.quant`).
    row_max = jnp.maximum(max_fenced(jnp.concatenate(logits, -1), -1), -1e30)  # [B, T, H]
    denom = jnp.exp(sink.astype(jnp.float32) - row_max)
    out = jnp.zeros(q.shape, jnp.float32)
    for seg, keys, s in zip(segments, keys_per_segment, logits, strict=True):
        p = jnp.exp(s - row_max[..., None])
        denom = denom + sum_last(p)[..., 0]  # index order, whatever the number of rows
        eq = "bths,bsd->bthd" if seg.ids.ndim == 2 else "bths,btsd->bthd"
        out = out + jnp.einsum(eq, round_bf16(p), keys, precision=jax.lax.Precision.HIGHEST)
    return round_bf16(exact_div(out, denom[..., None]))


def _sparse_attention_pallas(q, segments, sink, scale, backend, interpret):
    """`sparse_attention` through the paged kernels of `pallas_kernels.sparse_attention`: the pages and
    page tables are handed over as they are; only the ids become per query (-1 where not attended)."""
    from pallas_kernels.sparse_attention import sparse_attention_decode, sparse_attention_prefill

    b, t = q.shape[:2]
    kernel_segments = []
    for seg in segments:
        ids = seg.ids if seg.ids.ndim == 3 else jnp.broadcast_to(seg.ids[:, None, :], seg.valid.shape)
        idx = jnp.where(seg.valid, ids, -1).astype(jnp.int32)
        kernel_segments.append((seg.pages, seg.page_table.astype(jnp.int32), idx))
    kw = dict(scale=float(scale), backend=backend, interpret=interpret)
    sink = sink.astype(jnp.float32)
    if t == 1:
        decode_segments = [(pages, table, idx[:, 0]) for pages, table, idx in kernel_segments]
        return sparse_attention_decode(q[:, 0].astype(jnp.float32), decode_segments, sink, **kw)[:, None]
    return sparse_attention_prefill(q.astype(jnp.float32), kernel_segments, sink, **kw)


def index_scores(
    q: jax.Array,
    weights: jax.Array,
    key_pages: jax.Array,
    page_table: jax.Array,
    n_visible: jax.Array,
    *,
    impl: Impl = REFERENCE,
    block_entries: int = INDEX_SCORE_BLOCK,
) -> jax.Array:
    """The indexer's bf16 score of every key slot of each row, read from the paged FP4 index keys.

    q f32 [B, T, I, Dk] (FP4-fake-quantised index queries), weights f32 [B, T, I] (bf16, softmax
    scale folded in), key_pages u8 [P, S, Dk/2 + Dk/32], page_table i32 [B, n], n_visible i32 [B, T]
    (keys 0 .. n_visible-1 of the row are visible to query t) -> f32 [B, T, n * S]:
    bf16(sum_h bf16(relu(bf16(q_h . k_j)) * w_h)) where visible, else -inf.
    impl="reference" unpacks the row's pages through the table and sums the heads in order 0..I-1
    as explicit adds (the model's formula, `index_scores_unpacked`); impl="pallas..." runs
    `pallas_kernels.indexer.index_scores`, which reads each page through the table inside the
    kernel and sums the heads in order 0..I-1: in interpret mode with the reference's products (the
    TPU kernel then equals this path bit for bit), on hardware with its own accumulation inside each
    head's dot, so the two may differ by one bf16 ulp where a score straddles a rounding tie;
    impl="cpu" runs `pallas_kernels.indexer.kernel_cpu`, which reads the packed keys through the table
    (exact block sums added in order: this path's scores wherever the dots are exact). The
    contract (and the shapes each kernel supports) is `pallas_kernels.indexer.common`.

    block_entries (impl reference): the row is unpacked and scored in blocks of about this many key
    slots (whole pages), one after another, so a block's f32 keys stay in the CPU's cache instead of
    the whole row's (64 MB per row at 128K tokens and ratio 1). Every slot's score is its own dot
    product, so the scores are the same bit for bit whatever the blocks
    (tests/ced_jax/test_indexer_candidates.py). Blocks past every query's visible slots are not
    scored (their -inf is the same)."""
    from pallas_kernels import indexer

    b = indexer.validate_inputs(q, weights, key_pages, page_table, n_visible)[0]
    if impl.cpu:
        from pallas_kernels.indexer import kernel_cpu

        return kernel_cpu.index_scores(q, weights, key_pages, page_table, n_visible)
    if impl.pallas:
        return indexer.index_scores(
            q, weights, key_pages, page_table.astype(jnp.int32), n_visible.astype(jnp.int32),
            backend=impl.backend, interpret=impl.interpret,
        )  # fmt: skip
    from pallas_kernels import formats

    if block_entries < 1:
        raise ValueError(f"block_entries must be >= 1, got {block_entries}")
    keys_of = lambda table: formats.unpack_index_keys(  # noqa: E731
        key_pages[table].reshape(b, -1, key_pages.shape[-1])
    )
    width, per_page = page_table.shape[1], key_pages.shape[1]
    block = max(1, block_entries // per_page)  # pages per block
    if width <= block:
        return index_scores_unpacked(q, weights, keys_of(page_table), n_visible)
    blocks = -(-width // block)
    # The last block is padded with page 0; its slots lie past the row and are cut off below.
    table = jnp.pad(page_table, ((0, 0), (0, blocks * block - width)))

    limit = jnp.max(n_visible)  # no query of the call sees a slot at or past it
    unseen = jnp.full((b, q.shape[1], block * per_page), -jnp.inf, jnp.float32)

    def score_block(i):
        def score():
            pages = jax.lax.dynamic_slice_in_dim(table, i * block, block, axis=1)
            return index_scores_unpacked(q, weights, keys_of(pages), n_visible - i * block * per_page)

        # A block past every query's visible slots would score -inf throughout: its work is skipped,
        # so a call costs the context its rows have, not its table's width.
        return jax.lax.cond(i * block * per_page < limit, score, lambda: unseen)

    scores = jax.lax.map(score_block, jnp.arange(blocks, dtype=jnp.int32))  # [blocks, B, T, block * S]
    scores = jnp.moveaxis(scores, 0, 2).reshape(*scores.shape[1:3], blocks * block * per_page)
    return scores[..., : width * per_page]


def index_scores_at(
    q: jax.Array,
    weights: jax.Array,
    key_pages: jax.Array,
    page_table: jax.Array,
    entry_ids: jax.Array,
    valid: jax.Array,
) -> jax.Array:
    """`index_scores` (impl reference) of chosen key slots only, for a query that may only pick among
    them (a Reindex layer inside its candidate pool): entry_ids i32 [B, T, C] (slot j of row b is
    entry j % E of page page_table[b, j // E]), valid bool [B, T, C] -> f32 [B, T, C], -inf where not
    valid. Each score is bit for bit the one `index_scores` gives that slot: the same formula
    (`index_scores_unpacked`), one query row at a time as a decode step runs it
    (tests/ced_jax/test_indexer_candidates.py). Costs T x C key reads per row instead of the table's."""
    from pallas_kernels import formats

    b, t, c = entry_ids.shape
    per_page = key_pages.shape[1]
    ids = jnp.clip(entry_ids, 0, page_table.shape[1] * per_page - 1)
    pages = jnp.take_along_axis(page_table, (ids // per_page).reshape(b, t * c), axis=1).reshape(b, t, c)
    keys = formats.unpack_index_keys(key_pages[pages, ids % per_page]).reshape(b * t, c, -1)
    rows = lambda a: a.reshape(b * t, 1, *a.shape[2:])
    s = index_scores_unpacked(rows(q), rows(weights), keys, jnp.full((b * t, 1), c, jnp.int32))
    return jnp.where(valid, s.reshape(b, t, c), -jnp.inf)


def index_scores_unpacked(
    q: jax.Array, weights: jax.Array, keys: jax.Array, n_visible: jax.Array
) -> jax.Array:
    """`index_scores` on keys already unpacked, f32 [B, C, Dk] -> f32 [B, T, C], always in XLA: for
    keys that do not live in pages (the reference index-K mode's pointer, see
    `ced_jax.model.layers.attention.index_scores`) and as `index_scores`' reference path."""
    s = round_bf16(jnp.einsum("bthd,bsd->bths", q, keys, precision=jax.lax.Precision.HIGHEST))
    s = round_bf16(jax.nn.relu(s) * weights[..., None])
    s = round_bf16(sum_small(s, 2))  # heads 0..I-1 in order, whatever the number of rows
    visible = jnp.arange(keys.shape[1])[None, None, :] < n_visible[..., None]
    return jnp.where(visible, s, -jnp.inf)
