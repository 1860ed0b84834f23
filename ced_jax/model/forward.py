"""The DeepSeek-V4.1 text model: embed -> M streams -> blocks (Engram, attention, MoE under mHC)
-> collapse -> norm -> fp32 head.

Parameters mirror the released checkpoint's names ('layers.3.attn.wq_a.weight' is
params['layers']['3']['attn']['wq_a']['weight']) in their storage formats: FP8 e4m3 weights with
ue8m0 scale bytes (uint8), FP4 experts packed two per byte (uint8, stacked [E, ...]), f32 for the
reference's f32 tensors, and bf16 (or f32 holding bf16 values, for CPU speed) for the rest.
Their specs (shape, dtype, logical axes) are `ced_jax.model.params`; the math is the pure `forward`
over the plain parameter dict, which is what gets jitted.

Letters: B batch, T chunk tokens, D width, M hyper-connection streams, V vocab, L layers,
X experts (or top-k entries) per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ced_jax import sharding
from ced_jax.cache import PagedCache, StepMetadata, paged_cache_axes
from ced_jax.config import ModelConfig
from ced_jax.model.layers import moe as moe_lib
from ced_jax.model.layers.attention import attention, write_compressed_kv
from ced_jax.model.layers.common import f32_linear, materialized, rms_norm
from ced_jax.model.layers.engram import engram
from ced_jax.model.layers.mhc import hc_collapse, hc_expand, hc_mixes, stream_mean
from ced_jax.model.params import param_specs
from ced_jax.options import REFERENCE, Impl, IndexKeys
from ced_jax.quant import round_bf16


# ---------------------------------------------------------------------------------- forward
def _moe(
    p: dict,
    cfg: ModelConfig,
    x: jax.Array,
    forced_ids,
    impl: Impl,
    layout: sharding.Layout | None,
    image_mask: jax.Array | None = None,
):
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    scores = moe_lib.router_scores(flat, p["gate"]["weight"])
    forced = None if forced_ids is None else forced_ids.reshape(b * t, -1)
    bias = p["gate"]["bias"]
    if image_mask is not None:
        # Image-span tokens select experts with the vision bias (spec 6.3), per token: [N, E].
        bias = jnp.where(image_mask.reshape(b * t, 1), p["gate"]["bias_vl"], bias)
    ids, weights, own = moe_lib.route(
        scores,
        bias,
        cfg.num_experts_per_tok,
        cfg.routed_scaling_factor,
        cfg.norm_topk_prob,
        forced,
    )
    routed = moe_lib.routed_experts(
        flat, ids, weights, p["experts"], limit=cfg.swiglu_limit, impl=impl, layout=layout
    )
    shared = moe_lib.shared_expert(flat, p["shared_experts"], limit=cfg.swiglu_limit, impl=impl)
    return round_bf16(routed + shared).reshape(b, t, d), own.reshape(b, t, -1)


def _mixes(p: dict, site: str, x: jax.Array, cfg: ModelConfig):
    return hc_mixes(
        x,
        p[f"hc_{site}_fn"],
        p[f"hc_{site}_scale"],
        p[f"hc_{site}_base"],
        hc=cfg.hc_mult,
        iters=cfg.hc_sinkhorn_iters,
        norm_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
    )


def _engram_site(p: dict, cfg: ModelConfig, layer: int, x, engram_rows, image_mask, impl: Impl):
    """The streams after layer `layer`'s Engram (unchanged for a layer without one); image-span
    tokens keep their gate shut."""
    if layer not in cfg.engram_layer_ids:
        return x
    k = cfg.engram_layer_ids.index(layer)
    return engram(
        x,
        jax.tree.map(lambda a: a[:, :, k], engram_rows),
        p["engram"],
        eps=cfg.rms_norm_eps,
        token_mask=None if image_mask is None else ~image_mask,
        impl=impl,
    )


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    state: PagedCache,
    meta: StepMetadata,
    engram_rows: jax.Array | None = None,
    forced: dict | None = None,
    *,
    token_types: jax.Array | None = None,
    span_embeds: jax.Array | None = None,
    capture_blocks: bool = False,
    capture_main_hidden: bool = False,
    capture_chunk_state: bool = False,
    index_keys: IndexKeys = IndexKeys.INTENDED,
    impl: Impl = REFERENCE,
    layout: sharding.Layout | None = None,
    stop_at_layer: int | None = None,
):
    """Run one step: a chunk of tokens for every row of the batch, rows described by `meta`.

    tokens i32 [B, T]; state: the engine's `PagedCache` (not changed: the new one is returned); meta:
    `StepMetadata` (start, lens, slots, page tables of the rows); engram_rows i32 [B, T,
    n_engram_layers, C] from `EngramHasher` (tables in `params`), or with the tables on the host the
    gathered rows `ced_jax.engram_store.EngramStore.gather` returns ({"weight": FP8 [B, T,
    n_engram_layers, C, ehd], "scale": u8 [..., ehd / 32]}, `params` without the tables); forced:
    optional {'topk': {layer: i32 [B, T, X]},
    'experts': i32 [L, B, T, X], 'block_input': {layer: [B, T, M, D]}, 'pre_mix': {layer: [B, T, M]}}
    to replay recorded decisions / patch the inputs of chosen blocks.

    Image spans (spec 6.3): token_types i32 [B, T] (-1 text; 0 START, 1 IMAGE, 2 NEWLINE, 3 END of
    an image span) and span_embeds f32 [B, T, D] (bf16 values: aligner rows and the learned delimiter
    vectors at span positions, ignored elsewhere), given together or not at all. A span token's
    embedding is its span_embeds row, its experts are selected with `gate.bias_vl` in every MoE
    layer, and its Engram gate is shut; text tokens are computed exactly as without them.

    Returns (logits f32 [B, T, V], new state, aux) with aux = {'topk': {layer: own top-k},
    'experts': own expert ids [L, B, T, X], 'block_output' (if capture_blocks): [L, B, T, M, D],
    what each block produced, after the next layer's Engram}, plus with capture_main_hidden
    'main_hidden' [B, T, n_targets * D] (the DSpark input,
    `ced_jax.model.dspark.main_hidden`: per position the
    concatenation over dspark_target_layer_ids of each target layer's input averaged over the streams,
    bf16 values) and with capture_chunk_state 'chunk_state' (what the chunk wrote into the per-slot
    buffers, for `PagedCache.keep_accepted`). layout: the mesh and rules the
    parameters are laid out by (`sharding.make_layout`; None on one device), for the layers that
    lay out their own work (the MoE's expert-parallel dispatch).

    stop_at_layer: run only the blocks below this layer, then of this layer only its compressed-KV
    projection (`ced_jax.model.layers.attention.write_compressed_kv`, if it is a KV source): the state is
    what later tokens need from the chunk when the layers from stop_at_layer on are not run for it
    (CED prefill's encoder pass, `cfg.ced_boundary`); logits are then None and aux holds the
    decisions of the blocks that ran. None: every layer and the head.

    Under a layout whose page pool is split (`dp_ep`, `sharding.Layout.attention_axes`), each device
    runs its own rows (`_forward_per_device`): the rows, the state's slots and its pages are split
    into as many equal blocks as devices, row block d addressing only slots and pages of block d."""
    if layout is not None and layout.attention_axes and not layout.manual:
        return _forward_per_device(
            params, cfg, tokens, state, meta, engram_rows, forced, token_types=token_types,
            span_embeds=span_embeds, capture_blocks=capture_blocks,
            capture_main_hidden=capture_main_hidden, capture_chunk_state=capture_chunk_state,
            index_keys=index_keys, impl=impl, layout=layout, stop_at_layer=stop_at_layer,
        )  # fmt: skip
    impl, index_keys = Impl.parse(impl), IndexKeys.parse(index_keys)
    forced = forced or {}
    b, t = tokens.shape
    cache = state
    shared: dict[str, Any] = {}
    if index_keys is IndexKeys.REFERENCE and cfg.kv_source_layer_ids:
        # The released code's pointer still names the last KV source published in the previous call.
        width = max(cache.capacity("index_k", s, meta) for s in cfg.kv_source_layer_ids)
        last = cache.entries("index_k", cfg.kv_source_layer_ids[-1], meta)
        shared["index_k_ptr"] = jnp.pad(last, ((0, 0), (0, width - last.shape[1]), (0, 0)))
    if (token_types is None) != (span_embeds is None):
        raise ValueError("token_types and span_embeds must be given together")
    image_mask = None if token_types is None else token_types >= 0
    M = cfg.hc_mult
    h = round_bf16(params["embed"]["weight"].astype(jnp.float32)[tokens])
    if image_mask is not None:
        h = jnp.where(image_mask[..., None], round_bf16(span_embeds.astype(jnp.float32)), h)
    x = jnp.broadcast_to(h[:, :, None, :], (b, t, M, h.shape[-1]))
    pre = jnp.zeros((b, t, M), jnp.float32).at[..., 0].set(1.0)
    own_topk, own_experts, block_outputs, layer_inputs = {}, [], [], {}
    num_blocks = cfg.num_layers if stop_at_layer is None else stop_at_layer
    if not 0 <= num_blocks <= cfg.num_layers:
        raise ValueError(f"stop_at_layer must be in 0..{cfg.num_layers}, got {stop_at_layer}")
    for i in range(num_blocks):
        # Named per layer so a compiled program's instructions say which layer they belong to
        # (bench/launches.py); metadata only.
        with jax.named_scope(f"layer{i}"):
            p = params["layers"][str(i)]
            x = _engram_site(p, cfg, i, x, engram_rows, image_mask, impl)
            if capture_blocks and i > 0:
                block_outputs.append(x)
            if capture_main_hidden and i in cfg.dspark_target_layer_ids:
                layer_inputs[i] = x
            if str(i) in forced.get("block_input", {}):
                x = forced["block_input"][str(i)].astype(jnp.float32)
                pre = forced["pre_mix"][str(i)].astype(jnp.float32)
            # --- attention site (collapses with the previous site's pre: single-pass mHC)
            residual = x
            attn_pre, attn_post, attn_comb = _mixes(p, "attn", x, cfg)
            a_in = rms_norm(hc_collapse(x, pre), p["attn_norm"]["weight"], cfg.rms_norm_eps)
            y, topk, cache, shared = attention(
                p["attn"],
                cfg,
                i,
                a_in,
                meta,
                cache,
                shared,
                forced_topk=forced.get("topk", {}).get(str(i)),
                key_source=index_keys,
                impl=impl,
            )
            if topk is not None:
                own_topk[str(i)] = topk
            x = materialized(hc_expand(materialized(y, impl), residual, attn_post, attn_comb), impl)
            # --- FFN site
            residual = x
            ffn_pre, ffn_post, ffn_comb = _mixes(p, "ffn", x, cfg)
            f_in = rms_norm(hc_collapse(x, attn_pre), p["ffn_norm"]["weight"], cfg.rms_norm_eps)
            forced_ids = forced["experts"][i] if "experts" in forced else None
            y, ids = _moe(p["ffn"], cfg, f_in, forced_ids, impl, layout, image_mask)
            own_experts.append(ids)
            x = materialized(hc_expand(materialized(y, impl), residual, ffn_post, ffn_comb), impl)
            pre = ffn_pre
    if num_blocks < cfg.num_layers:
        p = params["layers"][str(num_blocks)]
        if num_blocks in cfg.kv_source_layer_ids:
            x = _engram_site(p, cfg, num_blocks, x, engram_rows, image_mask, impl)
            a_in = rms_norm(hc_collapse(x, pre), p["attn_norm"]["weight"], cfg.rms_norm_eps)
            cache, shared = write_compressed_kv(
                p["attn"], cfg, num_blocks, a_in, meta, cache, shared, key_source=index_keys
            )
        aux = {"topk": own_topk, "experts": jnp.stack(own_experts) if own_experts else None}
        if capture_chunk_state:
            aux["chunk_state"] = shared.get("chunk_state", {"window": {}, "compressor": {}})
        return None, cache, aux
    if capture_blocks:
        block_outputs.append(x)
    final = rms_norm(hc_collapse(x, pre), params["norm"]["weight"], cfg.rms_norm_eps)
    logits = f32_linear(final, params["head"]["weight"])
    aux = {"topk": own_topk, "experts": jnp.stack(own_experts)}
    if capture_blocks:
        aux["block_output"] = jnp.stack(block_outputs)
    if capture_main_hidden:
        layer_inputs[cfg.num_layers] = x
        # The reference averages the bf16 streams: the f32 mean of bf16 values, rounded to bf16.
        # (An explicit sum over the streams: one order per row, see ced_jax.quant.)
        means = [round_bf16(stream_mean(layer_inputs[l])) for l in cfg.dspark_target_layer_ids]
        aux["main_hidden"] = jnp.concatenate(means, axis=-1)
    if capture_chunk_state:
        aux["chunk_state"] = shared.get("chunk_state", {"window": {}, "compressor": {}})
    return logits, cache, aux


# ------------------------------------------------------------------ data-parallel attention (dp_ep)
def _block_index(ids: jax.Array, first: jax.Array, size: int) -> jax.Array:
    """Global slot / page ids -> ids within the device's block [first, first + size); an id outside
    it becomes `size` (out of range: its reads clamp to a page no visible position uses, its writes
    are dropped). The host puts every slot and written page of a row in the row's block
    (`ced_jax.engine.Engine.metadata` checks it), so only padding entries of a page table map there."""
    local = ids - first
    return jnp.where((local >= 0) & (local < size), local, size)


def _forward_per_device(params, cfg, tokens, state, meta, engram_rows, forced, *, layout, **options):
    """`forward` with attention data-parallel: a shard_map over every mesh axis in which each device
    runs its block of rows against its block of slots and pages (page tables and slots translated to
    the block), the MoE exchanging tokens by all-to-all (`ced_jax.model.layers.moe`). Parameters enter as
    the rules lay them out (the routed experts split over `expert`, the rest replicated)."""
    axes, shards = layout.attention_axes, layout.attention_shards
    # Image-span inputs are per-row arguments of the shard_map; the other options pass through.
    token_types, span_embeds = options.pop("token_types"), options.pop("span_embeds")
    rows = tokens.shape[0]
    max_slots = next(iter(state.window.values())).shape[0]
    pools = [*state.kv.values(), *state.index_k.values()]
    num_pages = pools[0].shape[0] if pools else shards
    for what, n in (("the step's rows", rows), ("max_slots", max_slots), ("num_pages", num_pages)):
        if n % shards:
            raise sharding.ShardingError(
                f"data-parallel attention over mesh axes {axes} ({shards} devices): {what} ({n}) must be "
                f"a multiple of {shards}, each device running an equal block"
            )
    by_row = lambda a: layout.row_spec(a.ndim)
    by_second = lambda a: layout.row_spec(a.ndim, axis=1)
    mesh, rules = layout.mesh, layout.rules
    state_specs = jax.tree.map(
        lambda ax, a: sharding.logical_to_spec(ax, rules, a.shape, mesh, name="state"),
        paged_cache_axes(state),
        state,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    specs = param_specs(cfg)
    used = {k: params[k] for k in ("embed", "layers", "norm", "head")}

    def param_spec(path, a):
        node = specs
        for key in path:
            node = node[key.key]
        return sharding.logical_to_spec(node.axes, rules, a.shape, mesh, name=sharding.path_name(path))

    param_in = jax.tree_util.tree_map_with_path(param_spec, used)
    forced_in = None
    if forced is not None:
        forced_in = {k: jax.tree.map(by_second if k == "experts" else by_row, v) for k, v in forced.items()}
    stopped = options["stop_at_layer"] is not None
    # Prefixes of the outputs' trees (a spec of one dimension covers every row-leading leaf below).
    rows_first, rows_second = layout.row_spec(1), layout.row_spec(2, axis=1)
    aux_out = {"topk": rows_first, "experts": rows_second}
    if options["capture_blocks"] and not stopped:
        aux_out["block_output"] = rows_second
    if options["capture_main_hidden"] and not stopped:
        aux_out["main_hidden"] = rows_first
    if options["capture_chunk_state"]:
        aux_out["chunk_state"] = rows_first
    local_slots, local_pages = max_slots // shards, num_pages // shards
    inner = dataclasses.replace(layout, manual=True)

    def body(params, tokens, state, meta, engram_rows, forced, token_types, span_embeds):
        shard = jax.lax.axis_index(axes)
        meta = dataclasses.replace(
            meta,
            slots=_block_index(meta.slots, shard * local_slots, local_slots),
            page_tables=_block_index(meta.page_tables, shard * local_pages, local_pages),
        )
        return forward(
            params, cfg, tokens, state, meta, engram_rows, forced, token_types=token_types,
            span_embeds=span_embeds, layout=inner, **options,
        )  # fmt: skip

    rowwise = lambda tree: jax.tree.map(by_row, tree)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            param_in,
            by_row(tokens),
            state_specs,
            rowwise(meta),
            rowwise(engram_rows),
            forced_in,
            rowwise(token_types),
            rowwise(span_embeds),
        ),  # fmt: skip
        out_specs=(None if stopped else rows_first, state_specs, aux_out),
        # Replicated parameters are read, never combined across devices; the MoE's all-to-alls are
        # the only collectives.
        check_vma=False,
    )
    return fn(used, tokens, state, meta, engram_rows, forced, token_types, span_embeds)
