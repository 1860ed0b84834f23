"""FP4 grouped matmul for NVIDIA GPUs (Pallas Triton backend).

Grid (M / tm, N / tn). Each program owns one output tile and loops over the experts whose row ranges
intersect its rows (the first and last are found with jnp in the wrapper, empty experts in between
are skipped with a `cond`, so their weights are never read), and for each over K in chunks of tk:
load the expert's packed codes u8 [tn, tk/2] and scales u8 [tn, tk/32], dequantise in registers
(nibbles interleaved with a Triton `join`, scales broadcast by reshape), and accumulate a bf16 dot
with f32 accumulation (exact products, see `pallas_kernels.formats`). Rows of other experts are
masked out of the expert's partial product, which also discards NaNs from padding rows.

Why Triton and not Mosaic GPU: this kernel must be checkable on a CPU-only machine, and the
HLO interpreter runs Triton-style bodies (plain jnp on refs) but has no rule for Mosaic GPU's
warpgroup MMA primitives. Triton lowering constraints: every array has power-of-two dims, dots
need dims >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import formats
from pallas_kernels._tiles import dot_nt, expand_scales_reshape, fp4_halves, interleave, log2_exact
from pallas_kernels.grouped_matmul.common import TileConfig, group_offsets, round_up, validate_inputs


def _pow2_divisor(n: int, candidates) -> int | None:
    return next((t for t in candidates if n % t == 0), None)


def default_config(m: int, n: int, k: int) -> TileConfig:
    tm = 16 if m <= 16 else 32 if m <= 512 else 64
    tn = _pow2_divisor(n, (128, 64, 32, 16)) or n
    tk = _pow2_divisor(k, (256, 128, 64)) or k
    return TileConfig(tm=tm, tn=tn, tk=tk, num_warps=4, num_stages=2)


def check_config(cfg: TileConfig, n: int, k: int) -> None:
    for name, v in (("tm", cfg.tm), ("tn", cfg.tn), ("tk", cfg.tk)):
        try:
            log2_exact(v)
        except ValueError:
            raise NotImplementedError(f"{name}={v}: the Triton lowering needs power-of-two tiles") from None
    if min(cfg.tm, cfg.tn) < 16 or cfg.tk < 64:
        raise NotImplementedError(f"tiles {cfg}: dots need tm, tn >= 16 and tk >= 64 (two FP4 scale blocks)")
    if n % cfg.tn or k % cfg.tk:
        raise NotImplementedError(f"tn={cfg.tn} must divide N={n} and tk={cfg.tk} must divide K={k}")


def check_addressable(*arrays) -> None:
    """Pallas Triton computes element offsets in i32 for arrays under 2^32 bytes, and Triton adds
    them to pointers as *signed* values: a u8 array of 2-4 GiB would be addressed wrongly past 2 GiB.
    (Per device, experts sharded over >= 2 devices stay far below; one full v41 layer does not.)"""
    for a in arrays:
        nbytes = a.size * a.dtype.itemsize
        if 2**31 <= nbytes < 2**32 and a.dtype.itemsize == 1:
            raise NotImplementedError(
                f"a {list(a.shape)} byte array ({nbytes / 2**30:.2f} GiB) is past i32 offsets; "
                "shard the experts so each device holds < 2 GiB of one weight"
            )


def _kernel(g0_ref, g1_ref, offs_ref, lhs_ref, w_ref, s_ref, out_ref, *, tm, tn, tk, k):
    i = pl.program_id(0)
    j = pl.program_id(1)
    rows = i * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)

    def partial_product(g):
        def k_step(c, acc):
            x = lhs_ref[pl.ds(i * tm, tm), pl.ds(c * tk, tk)]
            codes = w_ref[g, pl.ds(j * tn, tn), pl.ds(c * (tk // 2), tk // 2)]
            scales = s_ref[g, pl.ds(j * tn, tn), pl.ds(c * (tk // 32), tk // 32)]
            even, odd = fp4_halves(codes)
            w = interleave(even, odd) * expand_scales_reshape(
                formats.decode_ue8m0(scales.astype(jnp.int32)), 32
            )
            return acc + dot_nt(x, w)

        return jax.lax.fori_loop(0, k // tk, k_step, jnp.zeros((tm, tn), jnp.float32))

    def group_step(g, acc):
        lo, hi = offs_ref[g], offs_ref[g + 1]

        def add(acc):
            mask = (rows >= lo) & (rows < hi)
            return acc + jnp.where(mask, partial_product(g), 0.0)

        return jax.lax.cond(hi > lo, add, lambda a: a, acc)

    out_ref[...] = jax.lax.fori_loop(g0_ref[i], g1_ref[i] + 1, group_step, jnp.zeros((tm, tn), jnp.float32))


def gmm(lhs, w_packed, w_scale, group_sizes, *, interpret=False, config: TileConfig | None = None):
    """Pallas Triton grouped matmul; same contract as `reference.gmm`."""
    m, k, e, n = validate_inputs(lhs, w_packed, w_scale, group_sizes)
    cfg = config or default_config(m, n, k)
    check_config(cfg, n, k)
    check_addressable(w_packed)
    tm, tn, tk = cfg.tm, cfg.tn, cfg.tk
    m_pad = round_up(m, tm)
    offsets = group_offsets(group_sizes, m)
    starts = jnp.arange(m_pad // tm, dtype=jnp.int32) * tm
    # First and last expert whose rows meet each row tile (first > last: a tile past every group).
    g0 = jnp.searchsorted(offsets[1:], starts, side="right").astype(jnp.int32)
    g1 = (jnp.searchsorted(offsets[:-1], starts + tm, side="left") - 1).astype(jnp.int32)
    g1 = jnp.minimum(g1, e - 1)
    lhs_p = jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, tn=tn, tk=tk, k=k),
        grid=(m_pad // tm, n // tn),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="fp4_gmm_triton",
    )(g0, g1, offsets, lhs_p, w_packed, w_scale)
    return out[:m]
