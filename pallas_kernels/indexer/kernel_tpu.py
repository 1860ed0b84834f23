"""Indexer scoring for TPU (Mosaic): relu-weighted head sum of q . k over paged FP4 index keys.

Grid (B, T / rows, pages_per_seq). One step scores `rows` queries of a sequence against one page of
S keys (any S: the output block is one whole page); the page is chosen through the
scalar-prefetched page table, and pages past the keys any of the sequence's queries can see are
mapped onto the last needed page (no new DMA) and skipped. The
key page is dequantised in VMEM (nibbles split into even / odd halves, matched by q's even / odd
columns; scales spread with a 0/1 matmul, see `_tiles`), then each head's bf16 dot is rounded,
relu'd, weighted, rounded and added in head order (the contract's summation order). In interpret
mode each head's dot is one f32 product over the whole index head dim, the reference's (`_tiles`,
"the reference's order on XLA:CPU"), so the scores equal the reference path's bit for bit.

The page table is scalar prefetch, so it must fit in SMEM: B * pages_per_seq words.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats
from pallas_kernels._tiles import dot_nt, dot_nt_f32, expand_scales_mxu, fp4_halves, interleave
from pallas_kernels.indexer.common import TileConfig, pages_needed, select_topk, validate_inputs


def _kernel(
    table_ref,
    needed_ref,
    qe_ref,
    qo_ref,
    w_ref,
    nvis_ref,
    keys_ref,
    out_ref,
    *,
    n_heads,
    dk,
    per_page,
    reference_order,
):
    b = pl.program_id(0)
    page = pl.program_id(2)

    @pl.when(page >= needed_ref[b])
    def _():
        out_ref[...] = jnp.full(out_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(page < needed_ref[b])
    def _():
        even, odd = fp4_halves(keys_ref[:, pl.ds(0, dk // 2)])  # [S, Dk/2]
        scales = formats.decode_ue8m0(keys_ref[:, pl.ds(dk // 2, dk // 32)].astype(jnp.int32))
        spread = expand_scales_mxu(scales, 16)
        ke, ko = even * spread, odd * spread

        def head(h, acc):
            if reference_order:  # interpret mode: the reference's f32 product over all of Dk (`_tiles`)
                s = formats.round_bf16(dot_nt_f32(interleave(qe_ref[h], qo_ref[h]), interleave(ke, ko)))
            else:
                s = formats.round_bf16(dot_nt(qe_ref[h], ke) + dot_nt(qo_ref[h], ko))  # [rows, S]
            return acc + formats.round_bf16(jnp.maximum(s, 0.0) * w_ref[h])

        total = jax.lax.fori_loop(0, n_heads, head, jnp.zeros(out_ref.shape, jnp.float32))
        cols = page * per_page + jax.lax.broadcasted_iota(jnp.int32, (1, per_page), 1)
        out_ref[...] = jnp.where(cols < nvis_ref[...], formats.round_bf16(total), -jnp.inf)


def index_scores(
    q, weights, key_pages, page_table, n_visible, *, interpret=False, config: TileConfig | None = None
):
    """Same contract as `reference.index_scores`."""
    b, t, n_heads, dk = validate_inputs(q, weights, key_pages, page_table, n_visible)
    cfg = config or TileConfig()
    num_pages, per_page, nbytes = key_pages.shape
    n = page_table.shape[1]
    tq = min(cfg.rows, -(-t // 8) * 8)
    if tq % 8:
        raise NotImplementedError(f"rows={tq} must be a multiple of 8 on TPU")
    t_pad = -(-t // tq) * tq
    pad_t = ((0, 0), (0, t_pad - t))
    q_h = jnp.pad(jnp.moveaxis(q, 2, 1), ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))  # [B, I, T, Dk]
    w_h = jnp.pad(jnp.moveaxis(weights, 2, 1), ((0, 0), (0, 0), (0, t_pad - t)))[..., None]
    nvis = jnp.pad(n_visible.astype(jnp.int32), pad_t)[..., None]
    table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1).reshape(-1)
    needed = pages_needed(n_visible, per_page, n)

    def key_page(bi, ti, si, tab, need):
        return (tab[bi * n + jnp.minimum(si, need[bi] - 1)], 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, t_pad // tq, n),
        in_specs=[
            pl.BlockSpec((None, n_heads, tq, dk // 2), lambda bi, ti, si, tab, need: (bi, 0, ti, 0)),
            pl.BlockSpec((None, n_heads, tq, dk // 2), lambda bi, ti, si, tab, need: (bi, 0, ti, 0)),
            pl.BlockSpec((None, n_heads, tq, 1), lambda bi, ti, si, tab, need: (bi, 0, ti, 0)),
            pl.BlockSpec((None, tq, 1), lambda bi, ti, si, tab, need: (bi, ti, 0)),
            pl.BlockSpec((None, per_page, nbytes), key_page),
        ],
        # One output block per (query tile, page) with the page as a leading axis: the block's last
        # dim is then the whole `per_page` axis, so pages of any size (8 or 16 keys on small configs)
        # meet Mosaic's (8, 128) block rule; the pages are laid side by side afterwards in XLA.
        out_specs=pl.BlockSpec((None, None, tq, per_page), lambda bi, ti, si, tab, need: (bi, si, ti, 0)),
    )
    out = pl.pallas_call(
        functools.partial(
            _kernel, n_heads=n_heads, dk=dk, per_page=per_page, reference_order=bool(interpret)
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, n, t_pad, per_page), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=cfg.vmem_limit_bytes
        ),
        interpret=interpret,
        name="index_scores_tpu",
    )(table, needed, q_h[..., 0::2], q_h[..., 1::2], w_h, nvis, key_pages)
    return jnp.moveaxis(out, 1, 2).reshape(b, t_pad, n * per_page)[:, :t]


def index_topk(
    q, weights, key_pages, page_table, n_visible, *, top_k, candidates=None, interpret=False, config=None
):
    scores = index_scores(q, weights, key_pages, page_table, n_visible, interpret=interpret, config=config)
    return select_topk(scores, n_visible, top_k, candidates)
