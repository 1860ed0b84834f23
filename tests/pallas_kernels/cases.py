"""Seeded case generators shared by the kernel tests (and the shapes the lowering tests use).

Every generator poisons what a correct kernel must never read: lhs rows past the groups, weights
of empty experts, pages no table names, entries no query selects, and table slots past the pages a
sequence uses. Poison is NaN once decoded (0xFF bytes: e4m3 NaN, ue8m0 255 = NaN), so an
out-of-range read shows up as NaN in the output instead of a plausible number.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import formats

POISON = 0xFF
_pack_fp8 = jax.jit(formats.pack_fp8_entries)
_pack_fp4 = jax.jit(formats.pack_fp4_entries)
_pack_keys = jax.jit(formats.pack_index_keys)
_unpack_keys = jax.jit(formats.unpack_index_keys)
_pack_weight = jax.jit(formats.pack_fp4_weight)


def fp8_activations(rng: np.random.Generator, shape) -> np.ndarray:
    """f32 values on the FP8 e4m3 grid times per-row powers of two (as FP8-dequantised rows are)."""
    x = rng.standard_normal(shape).astype(np.float32) * 4
    x = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return x * np.exp2(rng.integers(-6, 6, shape[:-1] + (1,))).astype(np.float32)


def bf16_values(rng: np.random.Generator, shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16).astype(np.float32)


def ragged_sizes(rng: np.random.Generator, m: int, e: int, fill: float = 1.0) -> np.ndarray:
    """Group sizes over e experts summing to about fill * m, with empty groups (at least one when e > 1)."""
    total = int(round(m * fill))
    weights = rng.random(e) * (rng.random(e) < 0.6)
    if e > 1:
        weights[rng.integers(e)] = 0.0
    if weights.sum() == 0:
        weights[rng.integers(e)] = 1.0
    sizes = np.floor(weights / weights.sum() * total).astype(np.int32)
    sizes[np.argmax(weights)] += total - sizes.sum()
    return sizes


@dataclasses.dataclass
class GmmCase:
    lhs: np.ndarray  # f32 [M, K]
    w_packed: np.ndarray  # u8 [E, N, K/2]
    w_scale: np.ndarray  # u8 [E, N, K/32]
    group_sizes: np.ndarray  # i32 [E]

    def args(self):
        return tuple(jnp.asarray(a) for a in (self.lhs, self.w_packed, self.w_scale, self.group_sizes))


def gmm_case(seed: int, m: int, k: int, n: int, e: int, fill: float = 1.0) -> GmmCase:
    rng = np.random.default_rng(seed)
    sizes = ragged_sizes(rng, m, e, fill)
    lhs = fp8_activations(rng, (m, k))
    lhs[sizes.sum() :] = np.nan  # rows past the groups
    w = rng.standard_normal((e, n, k)).astype(np.float32) * np.exp2(rng.integers(-4, 4, (e, n, 1)))
    packed, scale = (np.array(a) for a in _pack_weight(w))
    empty = sizes == 0
    packed[empty], scale[empty] = POISON, POISON  # empty experts: never read
    return GmmCase(lhs, packed, scale, sizes)


@dataclasses.dataclass
class AttentionCase:
    q: np.ndarray  # f32 [B, T, H, D]
    segments: list  # [(u8 pages [P, S, bytes], i32 table [B, n], i32 idx [B, T, N])]
    sink: np.ndarray  # f32 [H]
    scale: float

    def args(self, decode: bool):
        q = self.q[:, 0] if decode else self.q
        segs = [
            (jnp.asarray(p), jnp.asarray(t), jnp.asarray(i[:, 0] if decode else i))
            for p, t, i in self.segments
        ]
        return jnp.asarray(q), segs, jnp.asarray(self.sink)


def _paged_segment(rng, b, t, d, fmt, per_page, pages_per_seq, n_sel, capacity):
    """Pages of `fmt` entries for b sequences holding `capacity` entries each, queries selecting
    n_sel ids (some -1, duplicates allowed), everything unselected poisoned."""
    used = -(-capacity // per_page)
    num_pages = b * pages_per_seq + 2  # spare pages no table names
    values = rng.standard_normal((num_pages, per_page, d)).astype(np.float32) * np.exp2(
        rng.integers(-3, 3, (num_pages, per_page, 1))
    )
    pack = _pack_fp8 if fmt == "fp8" else _pack_fp4
    pages = np.array(pack(values))
    perm = rng.permutation(num_pages)
    table = np.full((b, pages_per_seq), -1, np.int32)
    table[:, :used] = perm[: b * used].reshape(b, used)
    if pages_per_seq > used:  # slots past the sequence name a poisoned page, not only -1
        table[:, used] = perm[-1]
    idx = rng.integers(0, capacity, (b, t, n_sel)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    selected = np.zeros((num_pages, per_page), bool)
    for bi in range(b):
        ids = idx[bi][idx[bi] >= 0]
        selected[table[bi, ids // per_page], ids % per_page] = True
    pages[~selected] = POISON
    return pages, table, idx


def attention_case(seed, b, t, h, d, window=(8, 8, 16), main=(4, 6, 24), empty_row=True) -> AttentionCase:
    """window / main: (keys per page, pages per sequence, ids per query) or None to omit that segment."""
    rng = np.random.default_rng(seed)
    segments = []
    for fmt, spec in (("fp8", window), ("fp4", main)):
        if spec is not None:
            per_page, pps, n_sel = spec
            capacity = per_page * pps - per_page // 2  # the last page half used
            segments.append(_paged_segment(rng, b, t, d, fmt, per_page, pps, n_sel, capacity))
    if empty_row:  # a query with no valid entry must give zeros
        for _, _, idx in segments:
            idx[0, 0] = -1
    q = bf16_values(rng, (b, t, h, d))
    sink = rng.standard_normal(h).astype(np.float32)
    return AttentionCase(q, segments, sink, d**-0.5)


@dataclasses.dataclass
class IndexerCase:
    q: np.ndarray  # f32 [B, T, I, Dk]
    weights: np.ndarray  # f32 [B, T, I]
    key_pages: np.ndarray  # u8 [P, S, bytes]
    page_table: np.ndarray  # i32 [B, n]
    n_visible: np.ndarray  # i32 [B, T]

    def args(self):
        return tuple(
            jnp.asarray(a) for a in (self.q, self.weights, self.key_pages, self.page_table, self.n_visible)
        )


def indexer_case(seed, b, t, heads, dk, per_page, pages_per_seq) -> IndexerCase:
    rng = np.random.default_rng(seed)
    n_vis = rng.integers(0, per_page * pages_per_seq - per_page // 2, (b, t)).astype(np.int32)
    n_vis[0, 0] = 0  # nothing visible yet
    num_pages = b * pages_per_seq + 1
    keys = rng.standard_normal((num_pages, per_page, dk)).astype(np.float32)
    pages = np.array(_pack_keys(keys))
    table = rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    for bi in range(b):  # keys no query of the sequence can see: poisoned; table slots past: -1
        top = n_vis[bi].max()
        for p in range(pages_per_seq):
            lo = p * per_page
            if lo >= top:
                pages[table[bi, p]] = POISON
                table[bi, p] = -1 if p % 2 else table[bi, p]
            else:
                pages[table[bi, p], max(0, top - lo) :] = POISON
    spare = np.setdiff1d(np.arange(num_pages), table[table >= 0])
    pages[spare] = POISON
    # FP4-fake-quantised queries, as the model's are.
    q = np.array(_unpack_keys(_pack_keys(rng.standard_normal((b, t, heads, dk)).astype(np.float32))))
    weights = bf16_values(rng, (b, t, heads), 0.1)
    return IndexerCase(q, weights, pages, table, n_vis)


def sds(tree):
    """Arrays -> ShapeDtypeStructs (for lowering without data)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
