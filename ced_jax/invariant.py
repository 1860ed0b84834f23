"""Row-invariant f32 reductions and products: one order of operations per row, whatever the row count."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.formats import exact_div

# A row's (token's) result must not depend on how many rows share the call: speculative decoding
# verifies K drafted tokens in one [B, K+1] step and must reproduce one-token [B, 1] steps exactly,
# and a prompt must compute the same whether it comes as one chunk or page by page (the notebook API
# vs the server). XLA:CPU breaks that in three places (measured on jax 0.10.2,
# tests/ced_jax/test_invariance.py):
# - a dot with a single row (or column) runs as a matrix-vector product, whose summation order differs
#   from the matrix-matrix product of two rows or more (all row counts >= 2 agree with each other);
# - a reduce's order depends on its fusion and on the number of rows (e.g. a 1024-wide row sum
#   differs between 1-3 rows and 4+ rows, a 256-wide one when fused with its consumer);
# - once a fusion holding a reduce is large enough, XLA:CPU hands the whole fusion to YNNPACK (the
#   default `xla_cpu_experimental_ynn_fusion_type` includes reduce fusions), which evaluates the fused
#   elementwise ops with its own exp (and sums in its own order): the Sinkhorn row softmax of
#   `ced_jax.model.layers.mhc.hc_mixes`, exp(c - max(c)) over [T, 4, 4], changes in the last ulp from
#   T = 256 rows on. Which fusion goes to YNNPACK depends on its size, hence on B and T.
# So the model's f32 contractions go through `matmul_rows` (at least two rows), its long sums
# through `sum_last` (a `matmul_rows` against ones: sequential f32 accumulation, exact products) and
# its short sums through `sum_small` (explicit left-to-right adds), the RMS norms' mean of squares in
# torch's own order (`torch_mean_last`, explicit adds of squares that `rounded_square` keeps out of
# fused multiply-adds), the mHC's products rounded before their adds (`rounded_product`: prefill and
# decode fuse them differently, so a contraction could round them differently); its maxima whose result feeds
# inexact math (exp) are explicit (`max_small`) or a reduce fenced off from its neighbours
# (`max_fenced`). Each is one f32 order of operations per row, whatever the row count: the
# reference's numerics up to f32 summation order, as before.


def matmul_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] times w [N, K]^T in f32 (HIGHEST), every row's result independent of the
    number of rows: a lone row is padded with a zero row so the product is never a matrix-vector one."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    flat = x.reshape(rows, k)
    if rows == 1:
        flat = jnp.pad(flat, ((0, 1), (0, 0)))
    contract_k = (((1,), (1,)), ((), ()))
    y = jax.lax.dot_general(flat, w, contract_k, precision=jax.lax.Precision.HIGHEST)
    return y[:rows].reshape(*lead, w.shape[0])


def sum_last(x: jax.Array) -> jax.Array:
    """f32 sum over the last axis (kept, size 1), in index order for every row whatever their number.

    Two columns of ones: a one-column product would be a matrix-vector product again."""
    return matmul_rows(x, jnp.ones((2, x.shape[-1]), x.dtype))[..., :1]


# torch's CPU sum over a contiguous last axis of up to TORCH_LANES_MAX_WIDTH f32 values (torch 2.13,
# measured bit for bit on 2,000 random rows at widths 64-512): four accumulators of 8 lanes take 32
# values per step, are added together in order, then their 8 lanes in order, then the leftover
# values one by one. Wider rows go through more levels (not emulated: `mean_last` there).
TORCH_LANES, TORCH_ACCUMULATORS, TORCH_LANES_MAX_WIDTH = 8, 4, 512


def torch_sum_last(x: jax.Array) -> jax.Array:
    """f32 sum over the last axis (dropped) in torch's CPU order (above), as explicit adds: one order
    per row whatever the row count. Up to TORCH_LANES_MAX_WIDTH values."""
    n = x.shape[-1]
    if n > TORCH_LANES_MAX_WIDTH:
        raise ValueError(f"torch_sum_last: {n} values, at most {TORCH_LANES_MAX_WIDTH} emulated")
    step = TORCH_LANES * TORCH_ACCUMULATORS
    main = n // step * step
    lanes = x[..., :main].reshape(*x.shape[:-1], main // step, TORCH_ACCUMULATORS, TORCH_LANES)
    vector = None
    if main:
        accumulators = sum_small(lanes, -3)  # each accumulator over the steps, in order
        vector = sum_small(accumulators, -2)  # then the accumulators, in order
    total = None if vector is None else sum_small(vector, -1)
    for i in range(main, n):
        total = x[..., i] if total is None else total + x[..., i]
    return total


def torch_mean_last(x: jax.Array) -> jax.Array:
    """torch's CPU mean over the last axis (kept, size 1): `torch_sum_last` divided (exactly) by the
    count, where emulated; wider rows `mean_last`."""
    if x.shape[-1] > TORCH_LANES_MAX_WIDTH:
        return mean_last(x)
    return exact_div(torch_sum_last(x), float(x.shape[-1]))[..., None]


def reciprocal_sqrt(x: jax.Array) -> jax.Array:
    """torch's CPU rsqrt: 1 over a correctly rounded sqrt, a correctly rounded quotient. XLA's rsqrt is
    not always that f32 value, and XLA rewrites 1 / sqrt(x) as rsqrt(x) unless the sqrt is fenced
    (a no-op reduce_precision, which it keeps)."""
    root = jax.lax.reduce_precision(jnp.sqrt(x), exponent_bits=8, mantissa_bits=23)
    return exact_div(jnp.ones_like(root), root)


def rounded_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b rounded to f32 before any add it feeds, as torch's separate kernels compute it. In one
    fused loop XLA:CPU's LLVM contracts a multiply and the add it feeds into a fused multiply-add (one
    rounding fewer), and whether it does depends on how XLA fused the program: the prefill and decode
    programs fuse the same layer code differently, so an unfenced product can round differently in
    the two (PARITY.md, "RMS norms in torch's order"). A select the compiler cannot fold keeps the
    product apart; a NaN stays NaN."""
    product = a * b
    return jnp.where(product == product, product, jnp.float32(jnp.nan))


def rounded_square(x: jax.Array) -> jax.Array:
    """x * x rounded to f32 before the adds that sum it (`rounded_product`): 6 of 64 random f32 rows
    of 256 summed otherwise, the same at every row count. (bf16-exact inputs, as the text model's norms
    get, have exact squares: there the fence changes nothing.)"""
    return rounded_product(x, x)


def sum_small(x: jax.Array, axis: int) -> jax.Array:
    """f32 sum over a short axis (streams, experts of a token) as explicit left-to-right adds, so no
    reduce emitter picks the order. The axis is dropped."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def sum_axis(x: jax.Array, axis: int) -> jax.Array:
    """f32 sum over `axis` (dropped) in one order per row: `sum_small` for up to 16 terms, else
    `sum_last` with the axis moved last."""
    if x.shape[axis] <= 16:
        return sum_small(x, axis)
    return sum_last(jnp.moveaxis(x, axis, -1))[..., 0]


def max_small(x: jax.Array, axis: int) -> jax.Array:
    """Maximum over a short axis as explicit pairwise maxima: no reduce, so nothing around it can
    land in a YNNPACK reduce fusion (see above). The axis is dropped."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = jnp.maximum(total, part)
    return total


def max_fenced(x: jax.Array, axis: int) -> jax.Array:
    """Maximum over `axis` (dropped) as a reduce alone in its fusion: optimization barriers on its
    operand and result keep the producers and consumers (an exp) out of it, so none of them is
    evaluated by YNNPACK when XLA:CPU hands the reduce to it (see above). A maximum is exact in any
    order, so the reduce alone gives every row the same result whatever the row count."""
    x = jax.lax.optimization_barrier(x)
    return jax.lax.optimization_barrier(jnp.max(x, axis=axis))


def max_axis(x: jax.Array, axis: int) -> jax.Array:
    """`max_small` for up to 16 entries, else `max_fenced`."""
    return max_small(x, axis) if x.shape[axis] <= 16 else max_fenced(x, axis)


def mean_last(x: jax.Array) -> jax.Array:
    """torch's mean over the last axis: an f32 sum (`sum_last`) divided (exactly) by the count."""
    return exact_div(sum_last(x), float(x.shape[-1]))
