"""The one seam between the model and its kernels. Selection is explicit (`impl=`); an
unsupported implementation or shape raises, there is never a silent fallback.

impl="reference" is the pure-jnp path (the default on CPU and the parity target).
impl="pallas[:tpu|:gpu][:interpret]" runs the `pallas_kernels` kernels: the backend's own (Mosaic
on TPU, Triton on GPU) unless one is named; ":interpret" runs them in the Pallas HLO interpreter,
which is how they run on CPU (there the TPU kernels by default). The string travels as the model's
static `impl` argument, so the flag needs no other plumbing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ced_jax.quant import dequant_fp4_weight, exact_div, round_bf16

IMPLS = ("reference", "pallas")


def parse_impl(impl: str) -> tuple[str, str | None, bool]:
    """-> (kind, pallas backend or None, interpret). Raises NotImplementedError on anything else."""
    kind, *mods = impl.split(":")
    backend = next((m for m in mods if m in ("tpu", "gpu")), None)
    interpret = "interpret" in mods
    backends = [m for m in mods if m in ("tpu", "gpu")]
    bad = any(m not in ("tpu", "gpu", "interpret") for m in mods) or len(set(mods)) != len(mods)
    if kind not in IMPLS or bad or len(backends) > 1 or (kind == "reference" and mods):
        raise NotImplementedError(
            f"impl={impl!r} is not available; choose 'reference' or 'pallas[:tpu|:gpu][:interpret]'"
        )
    return kind, backend, interpret


def expert_matmul(rows: jax.Array, expert_ids: jax.Array, w: dict, *, impl: str = "reference") -> jax.Array:
    """rows [M, K] (FP8-dequantised activations) times each row's expert weight^T -> f32 [M, N].

    w: {'weight': u8 packed FP4 [E, N, K/2], 'scale': u8 e8m0 [E, N, K/32]}.
    Few rows (decode) gather only the touched experts; many rows sort by expert and use
    `lax.ragged_dot` over the dequantised expert stack. Both compute the same products in f32.
    impl="pallas..." sorts the rows by expert and runs the FP4 grouped-matmul kernel, which
    dequantises the weights tile by tile inside the kernel."""
    kind, backend, interpret = parse_impl(impl)
    num_experts = w["weight"].shape[0]
    if kind == "pallas":
        from pallas_kernels.grouped_matmul import gmm

        order = jnp.argsort(expert_ids, stable=True)
        group_sizes = jnp.bincount(expert_ids, length=num_experts).astype(jnp.int32)
        out_sorted = gmm(
            rows[order].astype(jnp.float32),
            w["weight"],
            w["scale"],
            group_sizes,
            backend=backend,
            interpret=interpret,
        )
        return jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    m = rows.shape[0]
    if m < num_experts:
        weight = dequant_fp4_weight(w["weight"][expert_ids], w["scale"][expert_ids])  # [M, N, K]
        return jnp.einsum("mk,mnk->mn", rows, weight, precision=jax.lax.Precision.HIGHEST)
    order = jnp.argsort(expert_ids)
    group_sizes = jnp.bincount(expert_ids, length=num_experts).astype(jnp.int32)
    weight = dequant_fp4_weight(w["weight"], w["scale"])  # [E, N, K]
    out_sorted = jax.lax.ragged_dot(
        rows[order], jnp.swapaxes(weight, 1, 2), group_sizes, precision=jax.lax.Precision.HIGHEST
    )
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)


def sparse_attention(
    q: jax.Array,
    segments: list[tuple[jax.Array, jax.Array, str]],
    sink: jax.Array,
    scale: float,
    *,
    impl: str = "reference",
) -> jax.Array:
    """Single-KV-head attention (V = K) over several key segments, with a per-head sink.

    q: [B, T, H, Dh]. Each segment is (keys, valid, layout): layout "shared" has keys [B, S, Dh]
    with valid [B, T, S] (window ring, chunk); layout "per_query" has keys [B, T, S, Dh] with valid
    [B, T, S] (gathered compressed entries). The sink adds exp(sink_h) to the denominator only;
    probabilities are rounded to bf16 before P.V (the reference's rounding point); a row with no
    valid key returns zeros. Output [B, T, H, Dh], rounded to bf16."""
    kind, backend, interpret = parse_impl(impl)
    if kind == "pallas":
        return _sparse_attention_pallas(q, segments, sink, scale, backend, interpret)
    scale = jnp.float32(scale)
    logits = []
    for keys, valid, layout in segments:
        eq = "bthd,bsd->bths" if layout == "shared" else "bthd,btsd->bths"
        s = jnp.einsum(eq, q, keys, precision=jax.lax.Precision.HIGHEST) * scale
        logits.append(jnp.where(valid[:, :, None, :], s, -jnp.inf))
    row_max = jnp.maximum(jnp.max(jnp.concatenate(logits, -1), axis=-1), -1e30)  # [B, T, H]
    denom = jnp.exp(sink.astype(jnp.float32) - row_max)
    out = jnp.zeros(q.shape, jnp.float32)
    for (keys, _, layout), s in zip(segments, logits, strict=True):
        p = jnp.exp(s - row_max[..., None])
        denom = denom + jnp.sum(p, axis=-1)
        eq = "bths,bsd->bthd" if layout == "shared" else "bths,btsd->bthd"
        out = out + jnp.einsum(eq, round_bf16(p), keys, precision=jax.lax.Precision.HIGHEST)
    return round_bf16(exact_div(out, denom[..., None]))


def _packed_or_nan(keys: jax.Array, pack, unpack) -> jax.Array:
    """Pack entries and poison (NaN scale bytes) any entry the format cannot hold exactly, so a
    caller handing non-quantised keys to the kernels gets NaN rather than a silently rounded result."""
    packed = pack(keys)
    exact = jnp.all(unpack(packed) == keys, axis=-1, keepdims=True)
    return jnp.where(exact, packed, jnp.uint8(0xFF))


def _sparse_attention_pallas(q, segments, sink, scale, backend, interpret):
    """`sparse_attention` through the paged kernels of `pallas_kernels.sparse_attention`.

    The layers still hand over unpacked f32 segments (the packed paged cache is read through
    `ced_jax.cache`'s accessors), so this bridge packs them, one page per sequence: "shared"
    segments (window ring, chunk) as FP8 window entries, "per_query" segments (gathered compressed
    entries) as FP4 main entries, which is what the model stores there. Packing is lossless on those
    values; ids are the entry positions, -1 where a key is invalid."""
    from pallas_kernels import formats
    from pallas_kernels.sparse_attention import sparse_attention_decode, sparse_attention_prefill

    b, t = q.shape[:2]
    table = jnp.arange(b, dtype=jnp.int32)[:, None]  # sequence b's single page is page b
    kernel_segments = []
    for keys, valid, layout in segments:
        if layout == "shared":  # keys [B, S, Dh]
            pages = _packed_or_nan(keys, formats.pack_fp8_entries, formats.unpack_fp8_entries)
            ids = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), valid.shape)
        else:  # keys [B, T, X, Dh]: query t's entries are ids t * X .. t * X + X - 1
            flat = keys.reshape(b, -1, keys.shape[-1])
            pages = _packed_or_nan(flat, formats.repack_fp4_entries, formats.unpack_fp4_entries)
            x = keys.shape[2]
            ids = jnp.arange(t * x, dtype=jnp.int32).reshape(1, t, x)
        kernel_segments.append((pages, table, jnp.where(valid, ids, -1).astype(jnp.int32)))
    kw = dict(scale=float(scale), backend=backend, interpret=interpret)
    sink = sink.astype(jnp.float32)
    if t == 1:
        decode_segments = [(pages, tab, ids[:, 0]) for pages, tab, ids in kernel_segments]
        return sparse_attention_decode(q[:, 0].astype(jnp.float32), decode_segments, sink, **kw)[:, None]
    return sparse_attention_prefill(q.astype(jnp.float32), kernel_segments, sink, **kw)
