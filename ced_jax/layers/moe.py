"""Mixture of experts: sqrtsoftplus router with a selection-only bias, clamped SwiGLU experts.

N tokens (flattened B*T), E routed experts, X = experts per token, F expert width.
Routing weights come from the *unbiased* scores at the selected ids, normalised by (sum + 1e-20)
when X > 1 and scaled by `routed_scaling_factor`; they multiply the activation *before* the down
projection, whose input is FP8-quantised. Contributions are summed in f32 in ascending expert id
order (as the reference's expert loop), then the shared expert's output is added.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ced_jax import ops
from ced_jax.layers.common import f32_linear, fp8_linear
from ced_jax.quant import exact_div, fp8_fake_quant, round_bf16


def router_scores(x: jax.Array, gate_weight: jax.Array) -> jax.Array:
    """sqrt(softplus(x W^T)) in f32. x: [N, D] -> [N, E]. torch's softplus returns x above 20."""
    logits = f32_linear(x, gate_weight)
    softplus = jnp.where(logits > 20.0, logits, jnp.log1p(jnp.exp(jnp.minimum(logits, 20.0))))
    return jnp.sqrt(softplus)


def route(
    scores: jax.Array,
    bias: jax.Array,
    top_k: int,
    scaling: float,
    norm_topk: bool,
    forced_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (ids used [N, X], weights [N, X] f32, own ids [N, X]). forced_ids replays a recorded routing."""
    _, own_ids = jax.lax.top_k(scores + bias, top_k)
    ids = own_ids if forced_ids is None else forced_ids
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk and top_k > 1:
        weights = exact_div(weights, jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids, weights * scaling, own_ids


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def routed_experts(
    x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, *, limit: float, impl: str
) -> jax.Array:
    """sum over the X selected experts of w2(weight * swiglu(w1 x, w3 x)), f32 [N, D].

    experts: {'w1'|'w2'|'w3': {'weight': u8 packed FP4 [E, out, in/2], 'scale': u8 e8m0 [E, out, in/32]}}."""
    n, top_k = ids.shape
    # Ascending expert order per token reproduces the reference's summation order.
    order = jnp.argsort(ids, axis=-1)
    ids = jnp.take_along_axis(ids, order, axis=-1)
    weights = jnp.take_along_axis(weights, order, axis=-1)
    xq = fp8_fake_quant(x)  # one activation quantisation serves every expert of the token
    flat_ids = ids.reshape(-1)
    rows = jnp.repeat(xq, top_k, axis=0)
    gate = round_bf16(ops.expert_matmul(rows, flat_ids, experts["w1"], impl=impl))
    up = round_bf16(ops.expert_matmul(rows, flat_ids, experts["w3"], impl=impl))
    hidden = round_bf16(weights.reshape(-1, 1) * swiglu(gate, up, limit))
    out = round_bf16(ops.expert_matmul(fp8_fake_quant(hidden), flat_ids, experts["w2"], impl=impl))
    out = out.reshape(n, top_k, -1)
    total = jnp.zeros(out.shape[::2], jnp.float32)
    for k in range(top_k):
        total = total + out[:, k]
    return total


def shared_expert(x: jax.Array, p: dict, *, limit: float) -> jax.Array:
    gate = fp8_linear(x, p["w1"]["weight"], p["w1"]["scale"])
    up = fp8_linear(x, p["w3"]["weight"], p["w3"]["scale"])
    return fp8_linear(round_bf16(swiglu(gate, up, limit)), p["w2"]["weight"], p["w2"]["scale"])
