"""Indexer scoring for NVIDIA GPUs (Pallas Triton backend); contract in `common`.

Grid (B, T / rows, pages_per_seq): one program scores `rows` queries of a sequence against one page
of S keys, read through the page table; pages past every query's visible keys are skipped. Keys
are dequantised in registers (nibbles interleaved with a `join`, scales broadcast by reshape); each
head is one bf16 dot [rows, Dk] x [Dk, S] whose rounded, relu'd, weighted result is added in head
order (Triton tensors cannot be indexed, so the heads are a loop over loads rather than a slice of
one big dot). rows must be a power of two >= 16 (a dot's minimum); decode pads its single query.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import formats
from pallas_kernels._tiles import dot_nt, expand_scales_reshape, fp4_halves, interleave, log2_exact
from pallas_kernels.indexer.common import TileConfig, pages_needed, select_topk, validate_inputs


def _kernel(table_ref, needed_ref, q_ref, w_ref, nvis_ref, keys_ref, out_ref, *, n_heads, dk, per_page, rows):
    b = pl.program_id(0)
    ti = pl.program_id(1)
    page = pl.program_id(2)

    def score(_):
        phys = table_ref[b, page]
        even, odd = fp4_halves(keys_ref[phys, :, pl.ds(0, dk // 2)])  # [S, Dk/2]
        scales = formats.decode_ue8m0(keys_ref[phys, :, pl.ds(dk // 2, dk // 32)].astype(jnp.int32))
        k = interleave(even, odd) * expand_scales_reshape(scales, 32)  # [S, Dk]

        def head(h, acc):
            s = formats.round_bf16(dot_nt(q_ref[b, h, pl.ds(ti * rows, rows), :], k))  # [rows, S]
            w = w_ref[b, h, pl.ds(ti * rows, rows)]
            return acc + formats.round_bf16(jnp.maximum(s, 0.0) * w[:, None])

        total = jax.lax.fori_loop(0, n_heads, head, jnp.zeros((rows, per_page), jnp.float32))
        cols = page * per_page + jax.lax.broadcasted_iota(jnp.int32, (rows, per_page), 1)
        nvis = nvis_ref[b, pl.ds(ti * rows, rows)]
        return jnp.where(cols < nvis[:, None], formats.round_bf16(total), -jnp.inf)

    out_ref[...] = jax.lax.cond(
        page < needed_ref[b], score, lambda _: jnp.full((rows, per_page), -jnp.inf, jnp.float32), None
    )


def index_scores(
    q, weights, key_pages, page_table, n_visible, *, interpret=False, config: TileConfig | None = None
):
    """Same contract as `reference.index_scores`."""
    b, t, n_heads, dk = validate_inputs(q, weights, key_pages, page_table, n_visible)
    cfg = config or TileConfig(rows=16)
    num_pages, per_page, _ = key_pages.shape
    n = page_table.shape[1]
    tq = max(cfg.rows, 16)
    try:
        log2_exact(tq)
        log2_exact(per_page)
        log2_exact(dk)
    except ValueError as e:
        raise NotImplementedError(
            f"Triton needs power-of-two rows, keys per page and head dim: {e}"
        ) from None
    t_pad = -(-t // tq) * tq
    q_h = jnp.pad(jnp.moveaxis(q, 2, 1), ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))  # [B, I, T, Dk]
    w_h = jnp.pad(jnp.moveaxis(weights, 2, 1), ((0, 0), (0, 0), (0, t_pad - t)))
    nvis = jnp.pad(n_visible.astype(jnp.int32), ((0, 0), (0, t_pad - t)))
    table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    out = pl.pallas_call(
        functools.partial(_kernel, n_heads=n_heads, dk=dk, per_page=per_page, rows=tq),
        grid=(b, t_pad // tq, n),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, tq, per_page), lambda bi, ti, si: (bi, ti, si)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, n * per_page), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="index_scores_triton",
    )(table, pages_needed(n_visible, per_page, n), q_h, w_h, nvis, key_pages)
    return out[:, :t]


def index_topk(
    q, weights, key_pages, page_table, n_visible, *, top_k, candidates=None, interpret=False, config=None
):
    scores = index_scores(q, weights, key_pages, page_table, n_visible, interpret=interpret, config=config)
    return select_topk(scores, n_visible, top_k, candidates)
