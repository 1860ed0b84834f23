"""Contract, validation and page-table resolution shared by the sparse-attention reference and kernels.

Letters: B sequences, T queries per sequence (prefill; decode has none), H heads, D head dim (K = V),
N entries a query may attend to in one segment, P pages, S entries per page.

    sparse_attention_decode(q [B, H, D], segments, sink [H], *, scale) -> f32 [B, H, D]
    sparse_attention_prefill(q [B, T, H, D], segments, sink [H], *, scale) -> f32 [B, T, H, D]

q holds bf16-exact f32 values. `segments` is a sequence of (pages, page_table, idx):
    pages       u8  [P, S, entry_bytes]  packed entries, FP8 (D + D/32 bytes, the SWA window) or
                                         FP4 (D/2 + D/16 bytes, compressed main entries); the format
                                         is read off entry_bytes
    page_table  i32 [B, pages_per_seq]   physical page of each logical page of a sequence
    idx         i32 [B, N] (decode) or [B, T, N] (prefill): the logical entries of the query's
                                         sequence it attends to; -1 = none
Entry j of sequence b lives at pages[page_table[b, j // S], j % S]. An id whose logical page is
past the table, or whose physical page is outside [0, P) (an unused page), is treated as -1, so
such pages are never read.

Per query and head: logits l_n = (q . k_n) * scale over every valid entry of every segment;
m = max(max_n l_n, -1e30); p_n = exp(l_n - m); out = sum_n bf16(p_n) k_n / (exp(sink - m) + sum_n p_n),
rounded to bf16. The sink enters the denominator only; probabilities are rounded to bf16 for P.V
only; a query with no valid entry gets zeros (its denominator is infinite). These are exactly the
semantics of `ced_jax.model.layers.kernels.sparse_attention`.

Kernels return the unnormalised (acc [R, H, D], denom [R, H]) over flattened query rows R; the
division happens here in XLA with a true division (XLA turns x / broadcast(y) into a reciprocal
multiply, which is not the reference's rounding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import formats

NEG_FLOOR = -1e30  # the reference's floor on the running max


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """rows: query rows per grid step (TPU); heads / entries: head and entry tile (GPU)."""

    rows: int = 8
    heads: int = 16
    entries: int = 32
    num_warps: int = 4
    num_stages: int = 1
    vmem_limit_bytes: int | None = None


def segment_format(entry_bytes: int, dim: int) -> str:
    if entry_bytes == formats.fp8_entry_bytes(dim):
        return "fp8"
    if entry_bytes == formats.fp4_entry_bytes(dim):
        return "fp4"
    raise ValueError(
        f"{entry_bytes}-byte entries match neither FP8 ({formats.fp8_entry_bytes(dim)} B) nor FP4 "
        f"({formats.fp4_entry_bytes(dim)} B) entries of head dim {dim}"
    )


def validate_inputs(q, segments, sink, *, decode: bool) -> tuple[int, int, int, int, list[str]]:
    """Static checks shared by reference and kernels; returns (B, T, H, D, formats). ValueError."""
    want = 3 if decode else 4
    if q.ndim != want or q.dtype != jnp.float32:
        shape = "[B, H, D]" if decode else "[B, T, H, D]"
        raise ValueError(f"q must be f32 {shape}, got {q.dtype}{list(q.shape)}")
    b, h, d = q.shape[0], q.shape[-2], q.shape[-1]
    t = 1 if decode else q.shape[1]
    if d % 32:
        raise ValueError(f"head dim {d} must be a multiple of 32")
    if sink.shape != (h,):
        raise ValueError(f"sink must be [{h}], got {list(sink.shape)}")
    if not segments:
        raise ValueError("at least one segment is needed")
    fmts = []
    for i, seg in enumerate(segments):
        if len(seg) != 3:
            raise ValueError(f"segment {i} must be (pages, page_table, idx)")
        pages, table, idx = seg
        if pages.ndim != 3 or pages.dtype != jnp.uint8:
            raise ValueError(
                f"segment {i}: pages must be uint8 [P, S, bytes], got {pages.dtype}{list(pages.shape)}"
            )
        fmts.append(segment_format(pages.shape[-1], d))
        if table.ndim != 2 or table.shape[0] != b or not jnp.issubdtype(table.dtype, jnp.integer):
            raise ValueError(
                f"segment {i}: page_table must be int [{b}, pages_per_seq], got {list(table.shape)}"
            )
        lead = (b,) if decode else (b, t)
        if idx.shape[:-1] != lead or idx.ndim != len(lead) + 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
            raise ValueError(f"segment {i}: idx must be int {list(lead) + ['N']}, got {list(idx.shape)}")
    return b, t, h, d, fmts


def resolve_rows(pages: jax.Array, table: jax.Array, idx: jax.Array) -> jax.Array:
    """Physical row of each id in pages viewed as [P * S, bytes]: i32 [B, ..., N], -1 where invalid."""
    num_pages, per_page = pages.shape[:2]
    b = idx.shape[0]
    flat = idx.reshape(b, -1).astype(jnp.int32)
    logical = jnp.where(flat >= 0, flat // per_page, 0)
    in_table = (flat >= 0) & (logical < table.shape[1])
    page = jnp.take_along_axis(table.astype(jnp.int32), jnp.clip(logical, 0, table.shape[1] - 1), axis=1)
    ok = in_table & (page >= 0) & (page < num_pages)
    rows = jnp.where(ok, page * per_page + flat % per_page, -1)
    return rows.reshape(idx.shape)


def finalize(acc: jax.Array, denom: jax.Array) -> jax.Array:
    """acc f32 [..., H, D], denom f32 [..., H] -> bf16-rounded output f32 [..., H, D]."""
    return formats.round_bf16(formats.exact_div(acc, denom[..., None]))


def flatten_rows(q, segments, decode: bool):
    """-> (q rows [R, H, D], [(pages [P*S, bytes], rows i32 [R, N])...]) with R = B (decode) or B*T."""
    h, d = q.shape[-2:]
    q_rows = q.reshape(-1, h, d)
    flat = []
    for pages, table, idx in segments:
        rows = resolve_rows(pages, table, idx)
        flat.append((pages.reshape(-1, pages.shape[-1]), rows.reshape(q_rows.shape[0], -1)))
    return q_rows, flat
