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

from ced_jax import sharding
from ced_jax.invariant import sum_small
from ced_jax.model.layers import kernels
from ced_jax.model.layers.common import f32_linear, fp8_linear, materialized
from ced_jax.options import REFERENCE, Impl
from ced_jax.quant import exact_div, expert_weight, fp8_fake_quant, round_bf16


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
        weights = exact_div(weights, sum_small(weights, -1)[..., None] + 1e-20)
    return ids, weights * scaling, own_ids


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    # torch's CPU silu is x / (1 + exp(-x)); jax.nn.silu (x * sigmoid(x)) differs in the last ulp.
    return exact_div(gate, 1 + jnp.exp(-gate)) * up


# Logical axes of every stacked routed-expert tensor ([E, out, in/2] weights and [E, out, in/32]
# scales); ced_jax.model.param_specs uses them too, so the shard_map specs and the parameter
# placement cannot disagree.
EXPERT_AXES = ("experts", "expert_mlp", None)


def _expert_rows(rows, eids, weights, experts: dict, *, limit: float, impl: Impl, f_axis=None):
    """Per (token, expert) entry: w2(weight * swiglu(w1 row, w3 row)), bf16-rounded f32 [R, out].

    rows [R, D] FP8-dequantised, eids [R] expert ids into `experts`, weights [R]. Under shard_map
    with w1/w3 split along F over `f_axis`, the hidden activation is all-gathered before its FP8
    quantisation, so the quantisation blocks and the w2 contraction are the unsplit ones."""
    num_experts = experts["w1"]["weight"].shape[0]
    if f_axis is None and not impl.reads_packed_experts and rows.shape[0] >= num_experts:
        # Prefill. Decode (fewer rows than experts) keeps the per-row gather of kernels.expert_matmul:
        # the expert loop measured 2x slower inside the whole mid decode step (BENCHMARKS.md).
        # At least two rows per tile: a one-row product sums in another order (`kernels.expert_matmul`).
        tile = max(2, min(EXPERT_ROW_TILE, rows.shape[0] // num_experts))
        return _expert_rows_by_expert(rows, eids, weights, experts, limit=limit, tile=tile)
    gate = round_bf16(kernels.expert_matmul(rows, eids, experts["w1"], impl=impl))
    up = round_bf16(kernels.expert_matmul(rows, eids, experts["w3"], impl=impl))
    hidden = round_bf16(weights[:, None] * swiglu(gate, up, limit))
    if f_axis is not None:
        hidden = jax.lax.all_gather(hidden, f_axis, axis=1, tiled=True)
    return round_bf16(kernels.expert_matmul(fp8_fake_quant(hidden), eids, experts["w2"], impl=impl))


# Rows per step of the loop over one expert's rows in `_expert_rows_by_expert`: small enough that
# the padding (at most one partial tile per expert) costs little, large enough for a real GEMM.
EXPERT_ROW_TILE = 32


def _expert_rows_by_expert(rows, eids, weights, experts: dict, *, limit: float, tile: int = EXPERT_ROW_TILE):
    """`_expert_rows` for many rows (prefill) on the reference path: one expert at a time.

    The rows are sorted by expert; a loop over the experts dequantises one expert's w1/w3/w2 (skipped
    when no row chose it) and runs its rows through them `tile` rows at a time. Transient memory is
    one expert's f32 weights instead of the whole layer's, and the FLOPs are the rows' own (plus at
    most one partial tile per expert), whereas `lax.ragged_dot` on CPU expands the rows into a
    dense [experts, rows, K] masked operand and multiplies every row by every expert. Each row's
    arithmetic is unchanged (the same f32 products, bf16 rounding points and FP8 quantisation
    blocks); only the summation order inside a GEMM may differ, as between any two GEMM shapes."""
    m, d = rows.shape
    num_experts = experts["w1"]["weight"].shape[0]
    order = jnp.argsort(eids, stable=True)
    counts = jnp.bincount(eids, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    # `tile` rows of padding so that the last tile of the last expert stays in bounds.
    rows_sorted = jnp.pad(rows[order], ((0, tile), (0, 0)))
    weights_sorted = jnp.pad(weights[order], (0, tile))
    out_dim = experts["w2"]["weight"].shape[1]
    hi = jax.lax.Precision.HIGHEST
    contract_in = (((1,), (1,)), ((), ()))  # [R, K] x [N, K] -> [R, N]

    def expert_step(e, out):
        def run(out):
            w = {k: expert_weight(experts[k], e) for k in ("w1", "w2", "w3")}

            def tile_step(i, out):
                start = starts[e] + i * tile
                r = jax.lax.dynamic_slice(rows_sorted, (start, 0), (tile, d))
                wt = jax.lax.dynamic_slice(weights_sorted, (start,), (tile,))
                gate = round_bf16(jax.lax.dot_general(r, w["w1"], contract_in, precision=hi))
                up = round_bf16(jax.lax.dot_general(r, w["w3"], contract_in, precision=hi))
                hidden = round_bf16(wt[:, None] * swiglu(gate, up, limit))
                y = round_bf16(
                    jax.lax.dot_general(fp8_fake_quant(hidden), w["w2"], contract_in, precision=hi)
                )
                mine = (i * tile + jnp.arange(tile)) < counts[e]  # the tail belongs to the next expert
                old = jax.lax.dynamic_slice(out, (start, 0), (tile, out_dim))
                return jax.lax.dynamic_update_slice(out, jnp.where(mine[:, None], y, old), (start, 0))

            return jax.lax.fori_loop(0, (counts[e] + tile - 1) // tile, tile_step, out)

        return jax.lax.cond(counts[e] > 0, run, lambda out: out, out)

    out_sorted = jax.lax.fori_loop(0, num_experts, expert_step, jnp.zeros((m + tile, out_dim), jnp.float32))
    return jnp.zeros((m, out_dim), jnp.float32).at[order].set(out_sorted[:m])


def _sum_in_order(out: jax.Array) -> jax.Array:
    """[N, X, D] -> [N, D]: f32 sum over the entries in their (ascending expert) order."""
    total = jnp.zeros(out.shape[::2], jnp.float32)
    for k in range(out.shape[1]):
        total = total + out[:, k]
    return total


def routed_experts(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    experts: dict,
    *,
    limit: float,
    impl: Impl,
    layout: sharding.Layout | None = None,
) -> jax.Array:
    """sum over the X selected experts of w2(weight * swiglu(w1 x, w3 x)), f32 [N, D].

    experts: {'w1'|'w2'|'w3': {'weight': u8 packed FP4 [E, out, in/2], 'scale': u8 e8m0 [E, out, in/32]}}
    (or {'weight': f32 [E, out, in]}, dequantised at load: `ced_jax.checkpoint.weight_layout`)."""
    n, top_k = ids.shape
    # Ascending expert order per token reproduces the reference's summation order.
    order = jnp.argsort(ids, axis=-1)
    ids = jnp.take_along_axis(ids, order, axis=-1)
    weights = jnp.take_along_axis(weights, order, axis=-1)
    if layout is not None:  # on a mesh (sharding.make_layout): expert-parallel dispatch
        return _routed_experts_sharded(x, ids, weights, experts, layout, limit=limit, impl=impl)
    xq = materialized(fp8_fake_quant(x), impl)  # one activation quantisation serves every expert of the token
    rows = jnp.repeat(xq, top_k, axis=0)
    out = _expert_rows(rows, ids.reshape(-1), weights.reshape(-1), experts, limit=limit, impl=impl)
    return _sum_in_order(out.reshape(n, top_k, -1))


def _routed_experts_sharded(x, ids, weights, experts, layout, *, limit: float, impl: Impl) -> jax.Array:
    """`routed_experts` under shard_map: dropless padded all_to_all dispatch and combine. Inside the
    shard_map of data-parallel attention (`layout.manual`) the tokens and experts are already this
    device's block, and the dispatch runs in place."""
    ml = sharding.moe_layout(layout, EXPERT_AXES, experts)
    n, top_k = ids.shape
    ep = ml.sizes[ml.ep_axis] if ml.ep_axis is not None else 1
    held = experts["w1"]["weight"].shape[0]  # the whole stack, or this device's block when manual
    local_experts = held if layout.manual else held // ep
    # Pad the tokens to a multiple of the token shards; padding entries are never dispatched.
    pad = 0 if layout.manual else -n % ml.token_shards
    valid = jnp.arange(n + pad) < n
    x = jnp.pad(x, ((0, pad), (0, 0)))
    ids = jnp.pad(ids, ((0, pad), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))

    def body(x, ids, weights, valid, ex):
        n_loc = ids.shape[0]
        xq = fp8_fake_quant(x)
        flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
        flat_valid = jnp.repeat(valid, top_k)
        token = jnp.repeat(jnp.arange(n_loc), top_k)
        if ml.ep_axis is None:
            out = _expert_rows(xq[token], flat_ids, flat_w, ex, limit=limit, impl=impl, f_axis=ml.f_axis)
        else:
            # Every local entry may go to one device, so capacity n_loc * X per destination is
            # dropless; each entry's slot is (destination, rank among the entries sent there).
            cap = n_loc * top_k
            dest = flat_ids // local_experts
            hit = (dest[:, None] == jnp.arange(ep)[None, :]) & flat_valid[:, None]
            rank = jnp.take_along_axis(jnp.cumsum(hit, axis=0), dest[:, None], axis=1)[:, 0] - 1
            slot = jnp.where(flat_valid, dest * cap + rank, ep * cap)  # out of range: not sent

            def dispatch(values):
                buf = jnp.zeros((ep * cap, *values.shape[1:]), values.dtype)
                buf = buf.at[slot].set(values, mode="drop")
                return jax.lax.all_to_all(buf, ml.ep_axis, 0, 0, tiled=True)

            rows = dispatch(xq[token])
            local_ids = dispatch(flat_ids % local_experts)
            row_w = dispatch(flat_w)  # unused slots carry weight 0 and expert 0: computed, discarded
            res = _expert_rows(rows, local_ids, row_w, ex, limit=limit, impl=impl, f_axis=ml.f_axis)
            back = jax.lax.all_to_all(res, ml.ep_axis, 0, 0, tiled=True)
            out = back[jnp.minimum(slot, ep * cap - 1)]
        total = _sum_in_order(out.reshape(n_loc, top_k, -1))
        if ml.d_axis is not None:
            total = jax.lax.all_gather(total, ml.d_axis, axis=1, tiled=True)
        return total

    if layout.manual:
        return body(x, ids, weights, valid, experts)
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(ml.token_spec(2), ml.token_spec(2), ml.token_spec(2), ml.token_spec(1), ml.expert_specs),
        out_specs=ml.token_spec(2),
        # The all-gathers over the width axes leave values equal across that axis, which the
        # varying-axes check cannot see.
        check_vma=False,
    )
    return fn(x, ids, weights, valid, experts)[:n]


def shared_expert(x: jax.Array, p: dict, *, limit: float, impl: Impl = REFERENCE) -> jax.Array:
    gate = fp8_linear(x, p["w1"], impl=impl)
    up = fp8_linear(x, p["w3"], impl=impl)
    return fp8_linear(round_bf16(swiglu(gate, up, limit)), p["w2"], impl=impl)
