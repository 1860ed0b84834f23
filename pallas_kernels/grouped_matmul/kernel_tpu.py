"""FP4 grouped matmul for TPU (Mosaic), megablox-style.

Grid (N / tn, V): for each output column tile, walk a *visit list* of (row tile, expert) pairs,
V = M/tm + E - 1 long, built with jnp and handed to the kernel as scalar prefetch. Visits are in
expert order, so each row tile's visits are consecutive: its output block stays resident in VMEM
and accumulates; rows outside the visited expert's range are masked. Empty experts get no visit
(their weights are never read). Row tiles past the last group get one invalid visit that zeroes
them. The list is padded with copies of its last visit, whose block indices do not change, so the
pipeline issues no DMA for them.

Inside a visit, the expert's packed weight tile u8 [tn, K/2] is dequantised in VMEM: low nibbles are
the even K indices, high nibbles the odd ones. Rather than interleaving them along lanes, the
wrapper splits lhs into its even and odd columns and the kernel does two matmuls. Scales are spread
along lanes with a 0/1 matmul (`_tiles.expand_scales_mxu`). Operands reach the MXU in bf16, exact
for FP8-dequantised activations and FP4 weights, with f32 accumulation. In interpret mode the halves
are put back together and multiplied as one f32 product over all of K, the reference's (`_tiles`,
"the reference's order on XLA:CPU").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import formats
from pallas_kernels._tiles import dot_nt, dot_nt_f32, expand_scales_mxu, fp4_halves, interleave
from pallas_kernels.grouped_matmul.common import TileConfig, group_offsets, round_up, validate_inputs


def default_config(m: int, n: int, k: int) -> TileConfig:
    tm = min(128, round_up(m, 8))
    tn = next((t for t in (512, 256, 128) if n % t == 0), n)
    return TileConfig(tm=tm, tn=tn)


def check_config(cfg: TileConfig, n: int) -> None:
    """Mosaic block rules: second-minor dims multiple of 8, minor dims multiple of 128 (or full)."""
    if cfg.tm % 8:
        raise NotImplementedError(f"tm={cfg.tm} must be a multiple of 8 on TPU")
    if n % cfg.tn or (cfg.tn % 128 and cfg.tn != n):
        raise NotImplementedError(f"tn={cfg.tn} must divide N={n} and be a multiple of 128 (or N itself)")


def visit_list(offsets: jax.Array, tm: int, m_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert id, row tile, valid) per visit, each i32 [m_tiles + E - 1] (see module docstring)."""
    e = offsets.shape[0] - 1
    sizes = offsets[1:] - offsets[:-1]
    first = offsets[:-1] // tm
    last = (offsets[1:] - 1) // tm
    counts = jnp.where(sizes > 0, last - first + 1, 0)
    ends = jnp.cumsum(counts)
    n_group_visits = ends[-1]
    covered = (offsets[-1] + tm - 1) // tm  # row tiles holding at least one live row
    last_group = jnp.max(jnp.where(sizes > 0, jnp.arange(e), 0))
    i = jnp.arange(m_tiles + e - 1, dtype=jnp.int32)
    g = jnp.clip(jnp.searchsorted(ends, i, side="right"), 0, e - 1).astype(jnp.int32)
    in_group = i < n_group_visits
    tail = i - n_group_visits  # row tiles past the last group, then padding
    tile = jnp.where(in_group, first[g] + i - (ends[g] - counts[g]), jnp.minimum(covered + tail, m_tiles - 1))
    expert = jnp.where(in_group, g, last_group)
    return expert.astype(jnp.int32), tile.astype(jnp.int32), in_group.astype(jnp.int32)


def _kernel(
    offs_ref, gid_ref, tid_ref, valid_ref, lhs_e_ref, lhs_o_ref, w_ref, s_ref, out_ref, *, tm, reference_order
):
    v = pl.program_id(1)
    tile = tid_ref[v]
    g = gid_ref[v]

    @pl.when((v == 0) | (tid_ref[jnp.maximum(v - 1, 0)] != tile))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(valid_ref[v] == 1)
    def _():
        even, odd = fp4_halves(w_ref[...])  # [tn, K/2] each
        scale = expand_scales_mxu(formats.decode_ue8m0(s_ref[...].astype(jnp.int32)), 16)
        if reference_order:  # interpret mode: the reference's f32 product over all of K (`_tiles`)
            lhs = interleave(lhs_e_ref[...], lhs_o_ref[...])
            prod = dot_nt_f32(lhs, interleave(even * scale, odd * scale))
        else:
            prod = dot_nt(lhs_e_ref[...], even * scale) + dot_nt(lhs_o_ref[...], odd * scale)
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mask = (rows >= offs_ref[g]) & (rows < offs_ref[g + 1])
        out_ref[...] += jnp.where(mask, prod, 0.0)


def gmm(lhs, w_packed, w_scale, group_sizes, *, interpret=False, config: TileConfig | None = None):
    """Pallas TPU grouped matmul; same contract as `reference.gmm`. interpret: HLO interpreter (True)
    or a `pltpu.InterpretParams` for the TPU simulator."""
    m, k, e, n = validate_inputs(lhs, w_packed, w_scale, group_sizes)
    cfg = config or default_config(m, n, k)
    check_config(cfg, n)
    tm, tn = cfg.tm, cfg.tn
    m_pad = round_up(m, tm)
    m_tiles = m_pad // tm
    offsets = group_offsets(group_sizes, m)
    expert, tile, valid = visit_list(offsets, tm, m_tiles)
    # Even / odd columns of lhs meet the low / high nibbles (see module docstring).
    lhs_e = jnp.pad(lhs[:, 0::2], ((0, m_pad - m), (0, 0)))
    lhs_o = jnp.pad(lhs[:, 1::2], ((0, m_pad - m), (0, 0)))
    half = k // 2
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n // tn, expert.shape[0]),
        in_specs=[
            pl.BlockSpec((tm, half), lambda j, v, offs, gid, tid, ok: (tid[v], 0)),
            pl.BlockSpec((tm, half), lambda j, v, offs, gid, tid, ok: (tid[v], 0)),
            pl.BlockSpec((None, tn, half), lambda j, v, offs, gid, tid, ok: (gid[v], j, 0)),
            pl.BlockSpec((None, tn, k // 32), lambda j, v, offs, gid, tid, ok: (gid[v], j, 0)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, offs, gid, tid, ok: (tid[v], j)),
    )
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, reference_order=bool(interpret)),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m_pad, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=cfg.vmem_limit_bytes
        ),
        interpret=interpret,
        name="fp4_gmm_tpu",
    )(offsets, expert, tile, valid, lhs_e, lhs_o, w_packed, w_scale)
    return out[:m]
