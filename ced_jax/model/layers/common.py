"""Small pure functions shared by every layer: RMSNorm, RoPE, and the three kinds of linear.

All activations are f32 arrays holding bf16-representable values (see `ced_jax.quant`); each
function rounds its output to bf16 exactly where DeepSeek's reference does.

Dimension letters: B batch, T tokens of this chunk, D model width, H heads, K contraction.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from ced_jax.invariant import matmul_rows, reciprocal_sqrt, rounded_square, torch_mean_last
from ced_jax.options import REFERENCE, Impl
from ced_jax.quant import fp8_fake_quant, linear_weight, round_bf16

HIGHEST = jax.lax.Precision.HIGHEST


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in f32, output rounded to bf16, as torch computes it on CPU: the mean of squares in its
    summation order and its rsqrt (`ced_jax.invariant`). x: [..., D], weight: [D]."""
    var = torch_mean_last(rounded_square(x))
    return round_bf16(weight.astype(jnp.float32) * (x * reciprocal_sqrt(var + jnp.float32(eps))))


def materialized(x: jax.Array, impl: Impl) -> jax.Array:
    """x; under impl="cpu" computed once into a buffer (`pallas_kernels._cpu.materialized`), since
    XLA:CPU would recompute an elementwise producer inside each consumer (the mHC residual streams
    and the experts' quantised rows: about a third of a `mid` decode step at 8 rows). Values unchanged."""
    if not impl.cpu:
        return x
    from pallas_kernels import _cpu

    return _cpu.materialized(x)


def fp8_linear(x: jax.Array, p: dict, block: int = 32, *, impl: Impl = REFERENCE) -> jax.Array:
    """y = act_quant(x) @ dequant(W)^T, rounded to bf16. p: {'weight': FP8 [N, K], 'scale': ue8m0
    block scales}, or {'weight': f32 [N, K]} already dequantised (`ced_jax.checkpoint.weight_layout`).

    impl="cpu" runs a stored FP8 pair through the CPU kernel, which decodes the weight inside the dot
    (`pallas_kernels.fp8_linear.kernel_cpu`: the f32 dot's values bit for bit); a weight the layout
    dequantised ("f32-dense") is an f32 dot for every impl."""
    xq = fp8_fake_quant(x, block)
    if impl.cpu and "scale" in p:
        from pallas_kernels.fp8_linear import kernel_cpu

        if block != kernel_cpu.BLOCK:
            raise ValueError(f"impl='cpu': the FP8 kernel reads blocks of {kernel_cpu.BLOCK}, not {block}")
        lead, k = xq.shape[:-1], xq.shape[-1]
        y = kernel_cpu.linear_rows(xq.reshape(-1, k), p["weight"], p["scale"])
        return round_bf16(y.reshape(*lead, y.shape[-1]))
    return round_bf16(matmul_rows(xq, linear_weight(p, block)))


def bf16_linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """A linear whose weight is bf16 in the reference: f32 accumulation, bf16 output."""
    return round_bf16(matmul_rows(x, weight.astype(jnp.float32)))


def f32_linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """A linear the reference runs in fp32 (router, ratio>1 compressor, head): no rounding."""
    return matmul_rows(x, weight.astype(jnp.float32))


def grouped_linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., G, K] times each group's weight [G, N, K]^T in f32 -> [..., G, N] (not rounded), every
    row's result independent of the number of rows (see `ced_jax.invariant.matmul_rows`)."""
    lead, (g, k) = x.shape[:-2], x.shape[-2:]
    rows = math.prod(lead)
    flat = jnp.moveaxis(x.reshape(rows, g, k), 1, 0)  # [G, rows, K]
    if rows == 1:
        flat = jnp.pad(flat, ((0, 0), (0, 1), (0, 0)))
    batch_g_contract_k = (((2,), (2,)), ((0,), (0,)))
    y = jax.lax.dot_general(flat, weight, batch_g_contract_k, precision=HIGHEST)  # [G, rows, N]
    return jnp.moveaxis(y[:, :rows], 0, 1).reshape(*lead, g, weight.shape[1])


# ------------------------------------------------------------------------------------- RoPE
@lru_cache(maxsize=16)
def rope_inv_freq(dim: int, base: float, yarn: tuple[float, float, float, int] | None) -> np.ndarray:
    """Per-pair rotation frequencies (f32, computed as the reference does in torch f32).

    yarn = (factor, beta_fast, beta_slow, original_max_position), or None for plain RoPE (the
    SWA-only layers). Dimensions whose wavelength fits the original context keep their frequency,
    those beyond it are divided by `factor`, with a linear ramp between."""
    f32 = np.float32
    # torch's f32 `base ** t` matches the f64 power rounded to f32; numpy's f32 power is off by
    # an ulp in a few entries (6 of 32 at theta 160000), enough to move a bf16 rounding of RoPE.
    exponent = (np.arange(0, dim, 2, dtype=f32) / f32(dim)).astype(np.float64)
    freqs = f32(1.0) / (np.float64(base) ** exponent).astype(f32)
    if yarn is not None:
        factor, beta_fast, beta_slow, original = yarn

        def corrected_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(max(high - low, 1e-3)), 0, 1)
        smooth = f32(1) - ramp
        freqs = freqs / f32(factor) * (f32(1) - smooth) + freqs * smooth
    return freqs.astype(f32)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, inverse: bool = False, rounding=round_bf16
) -> jax.Array:
    """Interleaved RoPE on the last `2*len(inv_freq)` dims of x; output rounded to bf16 by `rounding`
    (draft training passes a straight-through rounding, whose gradient is the identity).

    x: [..., Dh] with positions broadcastable to x.shape[:-1] (heads axes included by the caller).
    Adjacent pairs (2i, 2i+1) are one complex number; the no-RoPE part comes first."""
    rd = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], x[..., -rd:]
    pairs = tail.reshape(*tail.shape[:-1], rd // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rounding(rotated)], axis=-1)
