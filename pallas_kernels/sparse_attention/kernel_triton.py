"""Paged sparse attention for NVIDIA GPUs (Pallas Triton backend).

Grid (query rows, head tiles). Entry ids are resolved to physical rows in XLA (`common.flatten_rows`);
each program gathers its row's entries `entries` at a time straight from the flat u8 pages (a
vector-indexed load, masked by validity), dequantises them in registers (FP4 nibbles interleaved
back into natural order with a Triton `join`, scales broadcast by reshape) and runs bf16 dots with
f32 accumulation.

The softmax must round probabilities against the *final* row max (see `common`), and registers
cannot hold a whole row's logits, so each program makes two passes over the entries: the first
finds the max, the second accumulates denominators and bf16(p) . k. The second pass re-reads the
entries, mostly from L2.

Shapes: Triton needs power-of-two arrays and dots of >= 16, so heads are padded to the head tile
(>= 16) and entry lists to the entry tile with -1; D must be a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import formats
from pallas_kernels._tiles import dot_nn, dot_nt, expand_scales_reshape, fp4_halves, interleave, log2_exact
from pallas_kernels.sparse_attention.common import (
    NEG_FLOOR,
    TileConfig,
    finalize,
    flatten_rows,
    validate_inputs,
)


def _entries(pool_ref, rows, fmt, dim):
    """Gather and dequantise entries: rows i32 [n] (-1 = invalid) -> (valid [n], k f32 [n, D])."""
    valid = rows >= 0
    safe = jnp.where(valid, rows, 0)
    if fmt == "fp8":
        vals = pool_ref[safe, pl.ds(0, dim)].astype(jnp.int32)
        scales = formats.decode_ue8m0(pool_ref[safe, pl.ds(dim, dim // 32)].astype(jnp.int32))
        k = formats.decode_e4m3(vals) * expand_scales_reshape(scales, 32)
    else:
        even, odd = fp4_halves(pool_ref[safe, pl.ds(0, dim // 2)])
        scales = formats.decode_e4m3(pool_ref[safe, pl.ds(dim // 2, dim // 16)].astype(jnp.int32))
        k = interleave(even, odd) * expand_scales_reshape(scales, 16)
    return valid, jnp.where(valid[:, None], k, 0.0)


def _kernel(*refs, fmts, n_entries, tile_n, tile_h, dim, scale):
    n_seg = len(fmts)
    q_ref, sink_ref = refs[0], refs[1]
    rows_refs = refs[2 : 2 + n_seg]
    pools = refs[2 + n_seg : 2 + 2 * n_seg]
    acc_ref, denom_ref = refs[2 + 2 * n_seg :]
    r = pl.program_id(0)
    h = pl.program_id(1)
    q = q_ref[r, pl.ds(h * tile_h, tile_h), :]  # [th, D]

    def logits(s, c):
        rows = rows_refs[s][r, pl.ds(c * tile_n, tile_n)]
        valid, k = _entries(pools[s], rows, fmts[s], dim)
        return jnp.where(valid[None, :], dot_nt(q, k) * scale, -jnp.inf), k

    row_max = jnp.full((tile_h,), NEG_FLOOR, jnp.float32)
    for s in range(n_seg):
        row_max = jax.lax.fori_loop(
            0, n_entries[s] // tile_n, lambda c, m, s=s: jnp.maximum(m, logits(s, c)[0].max(axis=1)), row_max
        )
    denom = jnp.exp(sink_ref[pl.ds(h * tile_h, tile_h)] - row_max)
    acc = jnp.zeros((tile_h, dim), jnp.float32)
    for s in range(n_seg):

        def accumulate(c, carry, s=s):
            acc, denom = carry
            logit, k = logits(s, c)
            p = jnp.exp(logit - row_max[:, None])
            return acc + dot_nn(formats.round_bf16(p), k), denom + p.sum(axis=1)

        acc, denom = jax.lax.fori_loop(0, n_entries[s] // tile_n, accumulate, (acc, denom))
    acc_ref[...] = acc
    denom_ref[...] = denom


def _rows_attention(q_rows, flat, fmts, sink, scale, interpret, cfg: TileConfig):
    r_total, h, d = q_rows.shape
    try:
        log2_exact(d)
        log2_exact(cfg.heads)
        log2_exact(cfg.entries)
    except ValueError as e:
        raise NotImplementedError(f"Triton needs power-of-two head dim and tiles: {e}") from None
    if cfg.heads < 16 or cfg.entries < 16:
        raise NotImplementedError(f"head and entry tiles must be >= 16 for Triton dots, got {cfg}")
    th, tn = cfg.heads, cfg.entries
    h_pad = -(-h // th) * th
    q_p = jnp.pad(q_rows, ((0, 0), (0, h_pad - h), (0, 0)))
    sink_p = jnp.pad(sink.astype(jnp.float32), (0, h_pad - h))
    rows = [jnp.pad(rw, ((0, 0), (0, -rw.shape[1] % tn)), constant_values=-1) for _, rw in flat]
    acc, denom = pl.pallas_call(
        functools.partial(
            _kernel,
            fmts=tuple(fmts),
            n_entries=tuple(rw.shape[1] for rw in rows),
            tile_n=tn,
            tile_h=th,
            dim=d,
            scale=float(scale),
        ),
        grid=(r_total, h_pad // th),
        in_specs=[pl.no_block_spec] * (2 + 2 * len(flat)),
        out_specs=[
            pl.BlockSpec((None, th, d), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, th), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((r_total, h_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((r_total, h_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="sparse_attention_triton",
    )(q_p, sink_p, *rows, *[pages for pages, _ in flat])
    return acc[:, :h], denom[:, :h]


def sparse_attention_prefill(q, segments, sink, *, scale, interpret=False, config: TileConfig | None = None):
    """Same contract as `reference.sparse_attention_prefill`."""
    b, t, h, d, fmts = validate_inputs(q, segments, sink, decode=False)
    q_rows, flat = flatten_rows(q, segments, decode=False)
    acc, denom = _rows_attention(q_rows, flat, fmts, sink, scale, interpret, config or TileConfig())
    return finalize(acc, denom).reshape(b, t, h, d)


def sparse_attention_decode(q, segments, sink, *, scale, interpret=False, config: TileConfig | None = None):
    """Same contract as `reference.sparse_attention_decode`."""
    b, _, h, d, fmts = validate_inputs(q, segments, sink, decode=True)
    q_rows, flat = flatten_rows(q, segments, decode=True)
    acc, denom = _rows_attention(q_rows, flat, fmts, sink, scale, interpret, config or TileConfig())
    return finalize(acc, denom)
