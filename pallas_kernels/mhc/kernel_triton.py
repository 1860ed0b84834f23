"""The mHC mixing for NVIDIA GPUs (Pallas Triton backend); contract in `common`.

Grid (T / rows,): one program loops over the flattened streams in `k_chunk` slices, accumulating
the projection (an f32 dot against the projection padded to 32 rows, a power of two as Triton
needs) and the sum of squares, then runs the epilogue (splits, softmax, every Sinkhorn iteration)
in registers and writes its rows packed 32 wide. rows: a power of two >= 16 (a dot's minimum).
In interpret mode all rows are one block and the sums take the reference's forms over the whole
width (`_tiles`), as in the TPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._tiles import dot_nt_f32, log2_exact, row_sum
from pallas_kernels.mhc.common import TileConfig, epilogue, unpack, validate_inputs

WIDTH = 32  # mixes per row, padded: (2 + hc) * hc = 24 for hc = 4


def _kernel(
    x_ref, fn_ref, scale_ref, base_ref, out_ref, *, hc, iters, norm_eps, hc_eps, k, k_chunk, rows, exact
):
    def chunk(c, carry):
        acc, sum_sq = carry
        xs = x_ref[:, pl.ds(c * k_chunk, k_chunk)]
        acc = acc + dot_nt_f32(xs, fn_ref[:, pl.ds(c * k_chunk, k_chunk)])
        return acc, sum_sq + jnp.sum(xs * xs, axis=1, keepdims=True)

    if exact:  # interpret mode: whole-width products, the reference's forms (`_tiles`)
        x = x_ref[...]
        fn = fn_ref[pl.ds(0, (2 + hc) * hc), :]  # unpadded: the reference's product shape
        mixes, sum_sq = dot_nt_f32(x, fn), row_sum(x * x, reference_order=True)
    else:
        zeros = (jnp.zeros((rows, WIDTH), jnp.float32), jnp.zeros((rows, 1), jnp.float32))
        mixes, sum_sq = jax.lax.fori_loop(0, k // k_chunk, chunk, zeros)
    out_ref[...] = epilogue(
        mixes, sum_sq, k, scale_ref[...], base_ref[...],
        hc=hc, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps, width=WIDTH, exact=exact,
    )  # fmt: skip


def hc_mixes(x, fn, scale, base, *, hc, iters, norm_eps, hc_eps, interpret=False, config=None):
    """Same contract as `reference.hc_mixes`."""
    t, k, n_mix = validate_inputs(x, fn, scale, base, hc)
    cfg = config or TileConfig(rows=16)
    rows, k_chunk = max(cfg.rows, 16), min(cfg.k_chunk, k)
    try:
        log2_exact(rows)
        log2_exact(k_chunk)
    except ValueError as e:
        raise NotImplementedError(f"Triton needs power-of-two rows and k_chunk: {e}") from None
    if k % k_chunk or n_mix > WIDTH:
        raise NotImplementedError(f"hc * D = {k} must be a multiple of k_chunk={k_chunk}, hc <= 4")
    if interpret:  # all rows in one block: the reference's product shapes (`_tiles`; a lone row pairs up)
        rows = max(t, 2)
    t_pad = -(-t // rows) * rows
    x_p = jnp.pad(x, ((0, t_pad - t), (0, 0)))
    packed = pl.pallas_call(
        functools.partial(
            _kernel,
            hc=hc,
            iters=iters,
            norm_eps=norm_eps,
            hc_eps=hc_eps,
            k=k,
            k_chunk=k_chunk,
            rows=rows,
            exact=bool(interpret),
        ),
        grid=(t_pad // rows,),
        in_specs=[
            pl.BlockSpec((rows, k), lambda i: (i, 0)),
            pl.BlockSpec((WIDTH, k), lambda i: (0, 0)),
            pl.BlockSpec((1, 4), lambda i: (0, 0)),
            pl.BlockSpec((1, WIDTH), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((rows, WIDTH), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t_pad, WIDTH), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="hc_mixes_triton",
    )(
        x_p,
        jnp.pad(fn, ((0, WIDTH - n_mix), (0, 0))),
        jnp.pad(scale, (0, 1))[None],
        jnp.pad(base, (0, WIDTH - n_mix))[None],
    )
    return unpack(packed, t, hc)
