"""The mHC mixing for TPU (Mosaic); contract in `common`.

Grid (T / rows,): one step holds `rows` tokens' whole flattened streams in VMEM ([8, 16384] f32 is
512 KiB at v41-flash's width), forms the projection and the sum of squares on the matrix unit at
f32 precision, and runs the epilogue (splits, softmax, every Sinkhorn iteration) on [rows, 1]
columns. In interpret mode all rows are one block and the sum of squares is a product with ones,
the reference's forms (`_tiles.row_sum`), so the result equals `ced_jax.model.layers.mhc.hc_mixes`
compiled on its own bit for bit on XLA:CPU (not inside every larger program: see `__init__`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._tiles import dot_nt_f32, row_sum
from pallas_kernels.mhc.common import TileConfig, epilogue, unpack, validate_inputs


def _kernel(x_ref, fn_ref, scale_ref, base_ref, out_ref, *, hc, iters, norm_eps, hc_eps, reference_order):
    x = x_ref[...]
    sum_sq = row_sum(x * x, reference_order=reference_order)
    mixes = dot_nt_f32(x, fn_ref[...])
    out_ref[...] = epilogue(
        mixes, sum_sq, x.shape[1], scale_ref[...], base_ref[...],
        hc=hc, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps, width=out_ref.shape[1], exact=reference_order,
    )  # fmt: skip


def hc_mixes(x, fn, scale, base, *, hc, iters, norm_eps, hc_eps, interpret=False, config=None):
    """Same contract as `reference.hc_mixes`."""
    t, k, n_mix = validate_inputs(x, fn, scale, base, hc)
    cfg = config or TileConfig()
    if cfg.rows % 8:
        raise NotImplementedError(f"rows={cfg.rows} must be a multiple of 8 on TPU")
    rows = min(cfg.rows, -(-t // 8) * 8)
    if interpret:  # all rows in one block: the reference's product shapes (`_tiles`; a lone row pairs up)
        rows = max(t, 2)
    t_pad = -(-t // rows) * rows
    x_p = jnp.pad(x, ((0, t_pad - t), (0, 0)))  # zero rows: finite (rsqrt(eps) * 0), cut below
    packed = pl.pallas_call(
        functools.partial(
            _kernel, hc=hc, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps, reference_order=bool(interpret)
        ),
        grid=(t_pad // rows,),
        in_specs=[
            pl.BlockSpec((rows, k), lambda i: (i, 0)),
            pl.BlockSpec((n_mix, k), lambda i: (0, 0)),
            pl.BlockSpec((1, 3), lambda i: (0, 0)),
            pl.BlockSpec((1, n_mix), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((rows, n_mix), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t_pad, n_mix), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=cfg.vmem_limit_bytes
        ),
        interpret=interpret,
        name="hc_mixes_tpu",
    )(x_p, fn, scale[None], base[None])
    return unpack(packed, t, hc)
