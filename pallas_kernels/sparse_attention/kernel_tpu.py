"""Paged sparse attention for TPU (Mosaic): entries gathered one DMA per entry from packed pages.

Query rows (decode: one per sequence; prefill: every query of every sequence) are processed `rows`
per grid step. The physical row of every entry is resolved in XLA beforehand (`common.flatten_rows`),
so the kernel sees each segment's pages as a flat u8 [P * S, bytes] array left in HBM, plus the row
ids of the current step (SMEM, for DMA addresses), of the next step (SMEM, to prefetch) and again
in VMEM (vector masks). Step i starts the entry DMAs of step i + 1 into the other half of a
double buffer before it waits for its own, so gathering overlaps compute; hence the grid is
sequential ("arbitrary"). Invalid ids issue no DMA.

Per row, all of its entries are resident, so the softmax is exact in one pass: logits of every
segment, one max, then bf16-rounded probabilities times the entries (no online rescaling, which
would round the probabilities against a running max instead of the final one).

Dequantisation in VMEM: FP8 bytes and e2m1 nibbles are decoded with integer ops and bitcasts,
scales spread along lanes with a 0/1 matmul (see `_tiles`). FP4 entries stay split into their
even and odd halves (low / high nibbles): the wrapper passes q's even and odd columns and puts the
two halves of the FP4 part of the output back together. Decoded values that are not finite can
come from bytes never written (a buffer row of an invalid id, masked out of the logits) or from a
valid entry that is itself corrupt. Logits are formed from the decoded keys as they are, so a corrupt
valid entry makes its query's output NaN, as in the reference; P.V uses the keys with non-finite
values zeroed, so the garbage rows of invalid ids meet their zero probability as 0 * 0, not 0 * NaN.

In interpret mode the sums are the reference's (`_tiles`, "the reference's order on XLA:CPU"): f32
products, FP4 entries put back into whole rows for q.k and P.V, the denominator as a product with
ones; the output then equals `ced_jax.model.layers.kernels.sparse_attention`'s bit for bit on the same
segments. On
hardware the operands stay bf16 (exact) and the denominator a reduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats
from pallas_kernels._tiles import (
    dot_nn,
    dot_nn_f32,
    dot_nt,
    dot_nt_f32,
    expand_scales_mxu,
    fp4_halves,
    interleave,
    row_sum,
)
from pallas_kernels.sparse_attention.common import (
    NEG_FLOOR,
    TileConfig,
    finalize,
    flatten_rows,
    validate_inputs,
)


def _finite(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _kernel(*refs, fmts, n_entries, rows_per_step, dim, scale, reference_order):
    n_seg = len(fmts)
    has_fp8, has_fp4 = "fp8" in fmts, "fp4" in fmts
    it = iter(refs)
    rows_cur = [next(it) for _ in range(n_seg)]
    rows_next = [next(it) for _ in range(n_seg)]
    rows_vec = [next(it) for _ in range(n_seg)]
    q_ref = next(it) if has_fp8 else None
    qe_ref, qo_ref = (next(it), next(it)) if has_fp4 else (None, None)
    sink_ref = next(it)
    pools = [next(it) for _ in range(n_seg)]
    acc_ref = next(it) if has_fp8 else None
    acce_ref, acco_ref = (next(it), next(it)) if has_fp4 else (None, None)
    denom_ref = next(it)
    bufs = [next(it) for _ in range(n_seg)]
    sems = [next(it) for _ in range(n_seg)]

    step = pl.program_id(0)
    slot = jax.lax.rem(step, 2)

    def copies(rows_refs, to_slot, start: bool):
        for s in range(n_seg):

            def one_row(r, carry, s=s):
                def one_entry(n, carry):
                    row = rows_refs[s][r, n]

                    @pl.when(row >= 0)
                    def _():
                        copy = pltpu.make_async_copy(
                            pools[s].at[pl.ds(row, 1)],
                            bufs[s].at[to_slot, r, pl.ds(n, 1)],
                            sems[s].at[to_slot],
                        )
                        if start:
                            copy.start()
                        else:
                            copy.wait()

                    return carry

                return jax.lax.fori_loop(0, n_entries[s], one_entry, carry)

            jax.lax.fori_loop(0, rows_per_step, one_row, 0)

    @pl.when(step == 0)
    def _():
        copies(rows_cur, 0, start=True)

    @pl.when(step + 1 < pl.num_programs(0))
    def _():
        copies(rows_next, 1 - slot, start=True)

    copies(rows_cur, slot, start=False)

    # Interpret mode sums as the reference does (`_tiles`, "the reference's order on XLA:CPU"):
    # f32 products, FP4 entries as whole rows, the denominator as a product with ones.
    dot_qk, dot_pv = (dot_nt_f32, dot_nn_f32) if reference_order else (dot_nt, dot_nn)

    def one_query(r, carry):
        logits, keys = [], []
        for s, fmt in enumerate(fmts):
            buf = bufs[s]
            valid = rows_vec[s][pl.ds(r, 1), :] >= 0  # [1, N]
            if fmt == "fp8":
                vals = buf[slot, r, :, pl.ds(0, dim)].astype(jnp.int32)
                scales = formats.decode_ue8m0(buf[slot, r, :, pl.ds(dim, dim // 32)].astype(jnp.int32))
                k = formats.decode_e4m3(vals) * expand_scales_mxu(scales, 32)  # [N, D]
                logit = dot_qk(q_ref[r], k)
                keys.append((_finite(k),))
            else:
                even, odd = fp4_halves(buf[slot, r, :, pl.ds(0, dim // 2)])
                scales = formats.decode_e4m3(buf[slot, r, :, pl.ds(dim // 2, dim // 16)].astype(jnp.int32))
                spread = expand_scales_mxu(scales, 8)  # [N, D/2]
                ke, ko = even * spread, odd * spread
                if reference_order:  # one product over the whole head dim, in index order
                    logit = dot_qk(interleave(qe_ref[r], qo_ref[r]), interleave(ke, ko))
                else:
                    logit = dot_qk(qe_ref[r], ke) + dot_qk(qo_ref[r], ko)
                keys.append((_finite(ke), _finite(ko)))
            logits.append(jnp.where(valid, logit * scale, -jnp.inf))  # [H, N]
        row_max = logits[0].max(axis=1, keepdims=True)
        for logit in logits[1:]:
            row_max = jnp.maximum(row_max, logit.max(axis=1, keepdims=True))
        row_max = jnp.maximum(row_max, NEG_FLOOR)  # [H, 1]
        denom = jnp.exp(sink_ref[...] - row_max)
        acc = acc_e = acc_o = None
        for logit, key in zip(logits, keys, strict=True):
            p = jnp.exp(logit - row_max)
            denom = denom + row_sum(p, reference_order=reference_order)
            pb = formats.round_bf16(p)
            if len(key) == 1:
                part = dot_pv(pb, key[0])
                acc = part if acc is None else acc + part
            elif reference_order:  # one product over the whole head dim, split afterwards
                both = dot_pv(pb, interleave(*key))
                pe, po = both[:, 0::2], both[:, 1::2]
                acc_e = pe if acc_e is None else acc_e + pe
                acc_o = po if acc_o is None else acc_o + po
            else:
                pe, po = dot_pv(pb, key[0]), dot_pv(pb, key[1])
                acc_e = pe if acc_e is None else acc_e + pe
                acc_o = po if acc_o is None else acc_o + po
        if has_fp8:
            acc_ref[r] = acc
        if has_fp4:
            acce_ref[r] = acc_e
            acco_ref[r] = acc_o
        denom_ref[r] = denom
        return carry

    jax.lax.fori_loop(0, rows_per_step, one_query, 0)


def _rows_attention(q_rows, flat, fmts, sink, scale, interpret, cfg: TileConfig):
    """q_rows f32 [R, H, D], flat [(pages [P*S, bytes], rows i32 [R, N])] -> (acc [R, H, D], denom [R, H])."""
    r_total, h, d = q_rows.shape
    tq = min(cfg.rows, r_total)
    if tq % 8 and tq != r_total:
        raise NotImplementedError(f"rows per step {tq} must be a multiple of 8 (or all {r_total} rows)")
    r_pad = -(-r_total // tq) * tq
    steps = r_pad // tq
    pad_rows = ((0, r_pad - r_total),)
    has_fp8, has_fp4 = "fp8" in fmts, "fp4" in fmts
    rows = [jnp.pad(rw, pad_rows + ((0, 0),), constant_values=-1) for _, rw in flat]
    q_p = jnp.pad(q_rows, pad_rows + ((0, 0), (0, 0)))
    n_entries = [rw.shape[1] for rw in rows]

    cur = [pl.BlockSpec((tq, n), lambda i: (i, 0), memory_space=pltpu.SMEM) for n in n_entries]
    nxt = [
        pl.BlockSpec((tq, n), lambda i: (jnp.minimum(i + 1, steps - 1), 0), memory_space=pltpu.SMEM)
        for n in n_entries
    ]
    vec = [pl.BlockSpec((tq, n), lambda i: (i, 0)) for n in n_entries]
    q_args, q_specs = [], []
    if has_fp8:
        q_args.append(q_p)
        q_specs.append(pl.BlockSpec((tq, h, d), lambda i: (i, 0, 0)))
    if has_fp4:
        q_args += [q_p[..., 0::2], q_p[..., 1::2]]
        q_specs += [pl.BlockSpec((tq, h, d // 2), lambda i: (i, 0, 0))] * 2
    out_shape, out_specs = [], []
    if has_fp8:
        out_shape.append(jax.ShapeDtypeStruct((r_pad, h, d), jnp.float32))
        out_specs.append(pl.BlockSpec((tq, h, d), lambda i: (i, 0, 0)))
    if has_fp4:
        out_shape += [jax.ShapeDtypeStruct((r_pad, h, d // 2), jnp.float32)] * 2
        out_specs += [pl.BlockSpec((tq, h, d // 2), lambda i: (i, 0, 0))] * 2
    out_shape.append(jax.ShapeDtypeStruct((r_pad, h, 1), jnp.float32))
    out_specs.append(pl.BlockSpec((tq, h, 1), lambda i: (i, 0, 0)))
    scratch = [
        pltpu.VMEM((2, tq, n, pages.shape[-1]), jnp.uint8)
        for n, (pages, _) in zip(n_entries, flat, strict=True)
    ]
    scratch += [pltpu.SemaphoreType.DMA((2,)) for _ in flat]

    outs = pl.pallas_call(
        functools.partial(
            _kernel,
            fmts=tuple(fmts),
            n_entries=tuple(n_entries),
            rows_per_step=tq,
            dim=d,
            scale=float(scale),
            reference_order=bool(interpret),
        ),
        grid=(steps,),
        in_specs=cur
        + nxt
        + vec
        + q_specs
        + [pl.BlockSpec((h, 1), lambda i: (0, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * len(flat),
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=cfg.vmem_limit_bytes
        ),
        interpret=interpret,
        name="sparse_attention_tpu",
    )(*rows, *rows, *rows, *q_args, sink.astype(jnp.float32).reshape(h, 1), *[pages for pages, _ in flat])
    outs = list(outs)
    acc = jnp.zeros((r_pad, h, d), jnp.float32)
    if has_fp8:
        acc = outs.pop(0)
    if has_fp4:
        even, odd = outs.pop(0), outs.pop(0)
        acc = acc + jnp.stack([even, odd], axis=-1).reshape(r_pad, h, d)
    return acc[:r_total], outs.pop(0)[:r_total, :, 0]


def sparse_attention_prefill(q, segments, sink, *, scale, interpret=False, config: TileConfig | None = None):
    """Same contract as `reference.sparse_attention_prefill`."""
    b, t, h, d, fmts = validate_inputs(q, segments, sink, decode=False)
    q_rows, flat = flatten_rows(q, segments, decode=False)
    acc, denom = _rows_attention(q_rows, flat, fmts, sink, scale, interpret, config or TileConfig(rows=8))
    return finalize(acc, denom).reshape(b, t, h, d)


def sparse_attention_decode(q, segments, sink, *, scale, interpret=False, config: TileConfig | None = None):
    """Same contract as `reference.sparse_attention_decode`."""
    b, _, h, d, fmts = validate_inputs(q, segments, sink, decode=True)
    q_rows, flat = flatten_rows(q, segments, decode=True)
    acc, denom = _rows_attention(q_rows, flat, fmts, sink, scale, interpret, config or TileConfig(rows=8))
    return finalize(acc, denom)
