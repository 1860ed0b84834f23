"""DSpark draft stages of DeepSeek-V4.1 (spec 7.3): the pure forward pass (loading the `mtp.*` tensors:
`ced_jax.checkpoint.dspark`).

What the reference's draft forward computes (tests/golden/tiny-v/README.md, scenario 2):
- `main_x = main_norm(main_proj(main_hidden))`, main_hidden [.., n_targets * D] being the per-position
  concatenation over `dspark_target_layer_ids` of the block input averaged over the hc streams.
- Context insertion: each stage s writes `kv_norm(wkv(main_x))` at position p, RoPE'd and
  FP8-fake-quantised exactly like window KV, into its own SWA ring (slot p mod sliding_window).
- The draft step at position p: a block of B = dspark_block_size ids `[input_id] + [noise_id] * (B-1)`
  at positions p+1 .. p+B runs through the stages. Each stage is a SWA-only block (the backbone's
  layer code: mHC, attention, MoE with its own experts and `gate.bias`) whose queries see the ring
  slots holding positions <= p and all B block positions (no causal mask inside the block); the
  block's own KV is never written to the ring. Stage 0 gets the embedded ids copied to the hc
  streams with a one-hot pre-mix; stage s+1 gets stage s's streams and its last FFN-site pre-mix.
- After the last stage: hc collapse -> `norm` -> the backbone's shared `head` (f32) -> base logits.
  The Markov bias of draft position j is `markov_head.head(markov_head.embed(prev_id))` in f32, prev_id
  being the input id for j = 0 and the greedy draft id of position j-1 otherwise (sequential);
  logits = base + bias (f32). confidence = `confidence_head.proj(cat(head_input, markov_embed))` (f32).

Parameters keep the released names below `mtp.{k}.` (stage blocks mapped like backbone layers:
experts stacked [E, ...], `attn.wo_a` dequantised to bf16 as DeepSeek's convert.py does).

Letters: N rows (independent draft requests), B draft block positions, M hc streams, D width,
W window (ring slots), H heads, Dh head dim, V vocab, R Markov rank.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax.config import ModelConfig
from ced_jax.model.layers import kernels
from ced_jax.model.layers import moe as moe_lib
from ced_jax.model.layers.attention import ring_positions
from ced_jax.model.layers.common import apply_rope, f32_linear, fp8_linear, rms_norm, rope_inv_freq
from ced_jax.model.layers.mhc import hc_collapse, hc_expand, hc_mixes, stream_mean
from ced_jax.options import REFERENCE
from ced_jax.quant import fp8_fake_quant, round_bf16
from pallas_kernels import formats


def stage_params(params: dict, stage: int) -> dict:
    return params["mtp"][str(stage)]


# ------------------------------------------------------------------------------ main_x and rings
def main_hidden(cfg: ModelConfig, block_output: jax.Array) -> jax.Array:
    """The DSpark input from `ced_jax.model.forward(..., capture_blocks=True)`'s aux['block_output']
    [L, ..., M, D] (entry i = what block i produced = block i+1's input, after its Engram): per
    position, the concatenation over dspark_target_layer_ids l of the mean over the M streams of
    layer l's input, rounded to bf16 (the reference averages bf16 streams) -> [..., n_targets * D].

    Checked on tiny-v's DSpark prompt against `prefill_main_hidden` only loosely: without a top-k
    replay for that scenario our prefill drifts from the reference by the known top-k tie choices
    (median error 0 on target layers 3 and 4, most elements of layer 3 exact; f32 means are worse)."""
    means = [round_bf16(stream_mean(block_output[layer - 1])) for layer in cfg.dspark_target_layer_ids]
    return jnp.concatenate(means, axis=-1)


def main_x(params: dict, cfg: ModelConfig, main_hidden: jax.Array) -> jax.Array:
    """[..., n_targets * D] -> [..., D]: main_norm(main_proj(main_hidden)), bf16 values."""
    first = stage_params(params, 0)
    x = fp8_linear(main_hidden, first["main_proj"])
    return rms_norm(x, first["main_norm"]["weight"], cfg.rms_norm_eps)


def _inv_freq(cfg: ModelConfig):
    # The stages are SWA-only (compress ratio 0): plain RoPE at rope_theta, as the backbone's SWA layers.
    return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)


def _window_kv(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """kv_norm(wkv(x)), RoPE'd at `positions` and FP8-fake-quantised (block 32): window KV [..., Dh]."""
    a = p["attn"]
    kv = rms_norm(fp8_linear(x, a["wkv"]), a["kv_norm"]["weight"], cfg.rms_norm_eps)
    return fp8_fake_quant(apply_rope(kv, positions, _inv_freq(cfg)), 32)


def pack_rings(rings: jax.Array) -> jax.Array:
    """Dequantised rings [..., W, Dh] (FP8 values) -> the packed FP8 layout [..., W, fp8_entry_bytes]
    the engine's state keeps (`PagedCache.draft_window`); exact for `insert_context`'s values."""
    return formats.pack_fp8_entries(rings)


def empty_rings(cfg: ModelConfig, rows: int) -> jax.Array:
    """[S, N, W, Dh] zeros: every stage's ring for `rows` requests, before any insertion."""
    return jnp.zeros((cfg.num_nextn_predict_layers, rows, cfg.sliding_window, cfg.head_dim), jnp.float32)


def insert_context(
    params: dict, cfg: ModelConfig, rings: jax.Array, mx: jax.Array, start: jax.Array, lens: jax.Array
) -> jax.Array:
    """Context insertion: every stage writes the window KV of main_x rows mx [N, T, D] (positions
    start .. start + lens - 1 of each row; the rest is padding) into its ring, slot = position mod W,
    the newest position winning. rings [S, N, W, Dh] (dequantised FP8 values) -> the new rings."""
    positions = start[:, None] + jnp.arange(mx.shape[1])[None, :]
    new = []
    for s in range(cfg.num_nextn_predict_layers):
        kv = _window_kv(stage_params(params, s), cfg, mx, positions)
        new.append(cache_lib.ring_update(rings[s], kv, start, lens))
    return jnp.stack(new)


# ------------------------------------------------------------------------------------- a stage
def _stage_attention(
    p: dict, cfg: ModelConfig, x: jax.Array, ring: jax.Array, position: jax.Array
) -> jax.Array:
    """x: attn_norm output [N, B, D] of the block at positions position+1 .. position+B; ring
    [N, W, fp8_entry_bytes] (packed FP8, as the engine's state keeps it) holding positions <= position.
    Queries see every filled ring slot and all B block keys (no mask inside the block). -> [N, B, D]."""
    eps, inv_freq = cfg.rms_norm_eps, _inv_freq(cfg)
    n, b, _ = x.shape
    H, Dh = cfg.num_heads, cfg.head_dim
    positions = position[:, None] + 1 + jnp.arange(b)[None, :]
    a = p["attn"]
    qr = rms_norm(fp8_linear(x, a["wq_a"]), a["q_norm"]["weight"], eps)
    q = fp8_linear(qr, a["wq_b"]).reshape(n, b, H, Dh)
    q = apply_rope(q, positions[..., None], inv_freq)
    block_kv = _window_kv(p, cfg, x, positions)
    period = ring.shape[1]
    ring_pos = ring_positions(position + 1, period)  # [N, W]: -ve = never written
    own_page = jnp.arange(n, dtype=jnp.int32)[:, None]
    segments = [
        kernels.KeySegment(
            ring,
            own_page,
            jnp.broadcast_to(jnp.arange(period, dtype=jnp.int32), (n, period)),
            jnp.broadcast_to((ring_pos >= 0)[:, None, :], (n, b, period)),
        ),
        kernels.KeySegment(
            formats.pack_fp8_entries(block_kv),
            own_page,
            jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32), (n, b)),
            jnp.ones((n, b, b), bool),
        ),
    ]
    o = kernels.sparse_attention(q, segments, a["attn_sink"], Dh**-0.5)
    o = apply_rope(o, positions[..., None], inv_freq, inverse=True)
    groups = cfg.o_groups
    o = o.reshape(n, b, groups, H * Dh // groups)
    wo_a = a["wo_a"]["weight"].astype(jnp.float32).reshape(groups, cfg.o_lora_rank, -1)
    o = round_bf16(jnp.einsum("btgd,grd->btgr", o, wo_a, precision=jax.lax.Precision.HIGHEST))
    return fp8_linear(o.reshape(n, b, -1), a["wo_b"])


def _stage_moe(p: dict, cfg: ModelConfig, x: jax.Array, forced_ids: jax.Array | None):
    """The stage's MoE (its own dspark_n_routed_experts, top dspark_num_experts_per_tok, `gate.bias`:
    drafts are text). -> (out [N, B, D], own ids [N, B, X], weights used [N, B, X])."""
    n, b, d = x.shape
    flat = x.reshape(n * b, d)
    f = p["ffn"]
    scores = moe_lib.router_scores(flat, f["gate"]["weight"])
    forced = None if forced_ids is None else forced_ids.reshape(n * b, -1)
    ids, weights, own = moe_lib.route(
        scores,
        f["gate"]["bias"],
        cfg.dspark_num_experts_per_tok,
        cfg.routed_scaling_factor,
        cfg.norm_topk_prob,
        forced,
    )
    routed = moe_lib.routed_experts(flat, ids, weights, f["experts"], limit=cfg.swiglu_limit, impl=REFERENCE)
    shared = moe_lib.shared_expert(flat, f["shared_experts"], limit=cfg.swiglu_limit)
    out = round_bf16(routed + shared).reshape(n, b, d)
    return out, own.reshape(n, b, -1), weights.reshape(n, b, -1)


def _mixes(p: dict, site: str, x: jax.Array, cfg: ModelConfig):
    return hc_mixes(
        x, p[f"hc_{site}_fn"], p[f"hc_{site}_scale"], p[f"hc_{site}_base"],
        hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
    )  # fmt: skip


def stage_forward(
    params: dict,
    cfg: ModelConfig,
    stage: int,
    x: jax.Array,
    pre: jax.Array,
    ring: jax.Array,
    position: jax.Array,
    forced_ids: jax.Array | None = None,
):
    """One DSpark stage, a SWA-only block under single-pass mHC (as `ced_jax.model.forward`'s layers).

    x [N, B, M, D] streams, pre [N, B, M] the previous site's pre-mix, ring [N, W, fp8_entry_bytes]
    this stage's packed ring (`pack_rings`; positions <= position [N]), forced_ids optional [N, B, X]
    expert ids to replay.
    -> (streams [N, B, M, D], pre-mix for the next collapse [N, B, M], own expert ids, gate weights)."""
    p = stage_params(params, stage)
    eps = cfg.rms_norm_eps
    residual = x
    attn_pre, attn_post, attn_comb = _mixes(p, "attn", x, cfg)
    a_in = rms_norm(hc_collapse(x, pre), p["attn_norm"]["weight"], eps)
    y = _stage_attention(p, cfg, a_in, ring, position)
    x = hc_expand(y, residual, attn_post, attn_comb)
    residual = x
    ffn_pre, ffn_post, ffn_comb = _mixes(p, "ffn", x, cfg)
    f_in = rms_norm(hc_collapse(x, attn_pre), p["ffn_norm"]["weight"], eps)
    y, ids, weights = _stage_moe(p, cfg, f_in, forced_ids)
    x = hc_expand(y, residual, ffn_post, ffn_comb)
    return x, ffn_pre, ids, weights


def stage0_input(embed_weight: jax.Array, cfg: ModelConfig, input_ids: jax.Array):
    """Block ids [N, B] = [input_id, noise * (B-1)] -> (streams [N, B, M, D], one-hot pre [N, B, M])."""
    b = cfg.dspark_block_size
    ids = jnp.concatenate(
        [
            input_ids[:, None],
            jnp.full((input_ids.shape[0], b - 1), cfg.dspark_noise_token_id, input_ids.dtype),
        ],
        1,
    )
    h = round_bf16(embed_weight.astype(jnp.float32)[ids])
    x = jnp.broadcast_to(h[:, :, None, :], (*ids.shape, cfg.hc_mult, h.shape[-1]))
    pre = jnp.zeros((*ids.shape, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    return x, pre


# --------------------------------------------------------------------------------- the output
def head_input(x: jax.Array, pre: jax.Array) -> jax.Array:
    """The last stage's streams [N, B, M, D] collapsed with its pre-mix -> [N, B, D]."""
    return hc_collapse(x, pre)


def base_logits(params: dict, cfg: ModelConfig, head_weight: jax.Array, hin: jax.Array):
    """-> (norm output [N, B, D], base logits f32 [N, B, V]) through the last stage's `norm` and
    the backbone's shared head."""
    last = stage_params(params, cfg.num_nextn_predict_layers - 1)
    normed = rms_norm(hin, last["norm"]["weight"], cfg.rms_norm_eps)
    return normed, f32_linear(normed, head_weight)


def markov(params: dict, cfg: ModelConfig, prev_ids: jax.Array):
    """prev_ids [...] -> (markov_embed [..., R] (bf16 values), markov bias f32 [..., V])."""
    mh = stage_params(params, cfg.num_nextn_predict_layers - 1)["markov_head"]
    emb = mh["embed"]["weight"].astype(jnp.float32)[prev_ids]
    return emb, f32_linear(emb, mh["head"]["weight"])


def confidence(params: dict, cfg: ModelConfig, hin: jax.Array, markov_embed: jax.Array) -> jax.Array:
    """proj(cat(head_input, markov_embed)) in f32 -> [...], one unnormalised scalar per position."""
    proj = stage_params(params, cfg.num_nextn_predict_layers - 1)["confidence_head"]["proj"]["weight"]
    return f32_linear(jnp.concatenate([hin, markov_embed], axis=-1), proj)[..., 0]


def sequential_markov(
    params: dict, cfg: ModelConfig, base: jax.Array, input_ids: jax.Array, forced_prev=None
):
    """Greedy drafting through the Markov bias: position j's prev id is the input id (j = 0) or the
    draft id of j-1. base [N, B, V], input_ids [N]; forced_prev optional [N, B] prev ids to replay.
    -> (logits [N, B, V], bias [N, B, V], markov_embed [N, B, R], draft_ids [N, B+1])."""
    prev = input_ids
    logits, biases, embeds, drafts = [], [], [], [input_ids]
    for j in range(base.shape[1]):
        if forced_prev is not None:
            prev = forced_prev[:, j]
        emb, bias = markov(params, cfg, prev)
        row = base[:, j] + bias
        prev = jnp.argmax(row, axis=-1).astype(input_ids.dtype)
        logits.append(row)
        biases.append(bias)
        embeds.append(emb)
        drafts.append(prev)
    return jnp.stack(logits, 1), jnp.stack(biases, 1), jnp.stack(embeds, 1), jnp.stack(drafts, 1)


class DraftOutput(NamedTuple):
    stage_input: jax.Array  # [N, S, B, M, D]
    stage_pre_mix: jax.Array  # [N, S, B, M]
    gate_indices: jax.Array  # [N, S, B, X]
    gate_weights: jax.Array  # [N, S, B, X]
    last_stage_output: jax.Array  # [N, B, M, D]
    last_stage_pre_mix: jax.Array  # [N, B, M]
    head_input: jax.Array  # [N, B, D]
    head_norm_output: jax.Array  # [N, B, D]
    base_logits: jax.Array  # [N, B, V]
    markov_bias: jax.Array  # [N, B, V]
    markov_embed: jax.Array  # [N, B, R]
    logits: jax.Array  # [N, B, V]
    draft_ids: jax.Array  # [N, B+1]: the input id, then one greedy id per draft position
    confidence: jax.Array  # [N, B]


def draft_step(
    params: dict,
    cfg: ModelConfig,
    embed_weight: jax.Array,
    head_weight: jax.Array,
    rings: jax.Array,
    mx: jax.Array,
    input_ids: jax.Array,
    position: jax.Array,
) -> tuple[DraftOutput, jax.Array]:
    """One draft step at position p for N rows: insert main_x mx [N, D] of position p into every
    stage's ring, then draft B positions p+1 .. p+B from input_ids [N] (the main model's token for
    position p+1). rings [S, N, W, Dh]. -> (DraftOutput, new rings)."""
    rings = insert_context(params, cfg, rings, mx[:, None, :], position, jnp.ones_like(position))
    x, pre = stage0_input(embed_weight, cfg, input_ids)
    inputs, pres, gids, gws = [], [], [], []
    packed = pack_rings(rings)
    for s in range(cfg.num_nextn_predict_layers):
        inputs.append(x)
        pres.append(pre)
        x, pre, ids, w = stage_forward(params, cfg, s, x, pre, packed[s], position)
        gids.append(ids)
        gws.append(w)
    hin = head_input(x, pre)
    normed, base = base_logits(params, cfg, head_weight, hin)
    logits, bias, emb, drafts = sequential_markov(params, cfg, base, input_ids)
    conf = confidence(params, cfg, hin, emb)
    out = DraftOutput(
        jnp.stack(inputs, 1), jnp.stack(pres, 1), jnp.stack(gids, 1), jnp.stack(gws, 1),
        x, pre, hin, normed, base, bias, emb, logits, drafts, conf,
    )  # fmt: skip
    return out, rings


# ------------------------------------------------------------------- on the engine's state
def insert_into_state(params: dict, cfg: ModelConfig, state, meta, mx: jax.Array):
    """Context insertion into the engine's state: main_x rows mx [B, T, D] of a chunk described by
    meta (`StepMetadata`: positions start .. start + lens - 1 of slots) go into every stage's packed
    ring `state.draft_window` (as `insert_context`). -> the new state."""
    positions = meta.positions(mx.shape[1])
    for s in range(cfg.num_nextn_predict_layers):
        kv = _window_kv(stage_params(params, s), cfg, mx, positions)
        state = state.write_draft_window(s, meta, formats.pack_fp8_entries(kv))
    return state


class Drafts(NamedTuple):
    tokens: jax.Array  # i32 [N, B]: the drafted ids, position p+2 .. p+B+1
    filtered_logits: jax.Array  # f32 [N, B, V]: the distribution each was drawn from (`draft_token`)
    confidence: jax.Array  # f32 [N, B]: the confidence head (unnormalised; sigmoid = acceptance estimate)


def draft(
    params: dict,
    cfg: ModelConfig,
    embed_weight: jax.Array,
    head_weight: jax.Array,
    rings: list,
    input_ids: jax.Array,
    position: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seed: jax.Array,
) -> Drafts:
    """Draft B = dspark_block_size tokens for N rows from the packed stage rings (rings[s] [N, W,
    fp8_entry_bytes], holding positions <= position [N]) and input_ids [N] (the target's token at
    position + 1): the block runs through the stages, then the Markov head chains the draws position
    by position (greedy rows: argmax, sampled rows: a draw from the draft's filtered distribution,
    `ced_jax.sampling.draft_token`)."""
    from ced_jax.sampling import draft_token

    x, pre = stage0_input(embed_weight, cfg, input_ids)
    for s in range(cfg.num_nextn_predict_layers):
        x, pre, _, _ = stage_forward(params, cfg, s, x, pre, rings[s], position)
    hin = head_input(x, pre)
    _, base = base_logits(params, cfg, head_weight, hin)
    prev = input_ids
    tokens, filtered, embeds = [], [], []
    for j in range(base.shape[1]):
        emb, bias = markov(params, cfg, prev)
        prev, q = draft_token(base[:, j] + bias, position + 2 + j, temperature, top_p, top_k, seed)
        prev = prev.astype(input_ids.dtype)
        tokens.append(prev)
        filtered.append(q)
        embeds.append(emb)
    conf = confidence(params, cfg, hin, jnp.stack(embeds, 1))
    return Drafts(jnp.stack(tokens, 1), jnp.stack(filtered, 1), conf)


def confident_prefix(confidence: np.ndarray, threshold: float) -> np.ndarray:
    """How many of each row's drafts to verify when the confidence head chooses (host side):
    confidence [..., K] (`next_confidence`, unnormalised) -> int32 [...], the longest prefix whose
    running product of sigmoid(confidence) (the estimated probability that every draft so far is
    accepted) stays >= threshold, at least 1 (a verify step has one draft position anyway)."""
    odds = 1.0 / (1.0 + np.exp(-np.asarray(confidence, np.float64)))
    return np.maximum(1, np.sum(np.cumprod(odds, axis=-1) >= threshold, axis=-1)).astype(np.int32)
