"""Training the DSpark draft stages by self-distillation (issue 15, point 4).

Random draft weights accept nothing, so a small checkpoint whose draft agrees with its target is made
here: the backbone is frozen, its own greedy continuations of varied prompts are the data, and every
`mtp.*` tensor is trained so that the draft step at position p predicts the backbone's greedy tokens
x_{p+2} .. x_{p+B+1} (`ced_jax.model.dspark`, module docstring: the block [x_{p+1}, noise * (B-1)] at
positions p+1 .. p+B over rings holding main_x of positions <= p).

- Data (`greedy_continuations`): the prompt is prefilled with the blocks' outputs captured, then each
  greedy token is fed back one step at a time, again capturing, so main_hidden at every position is
  what the engine computes there (prefill for the prompt, decode for the continuation) and the targets
  are exactly the backbone's greedy tokens. The backbone's logits at each position are kept for the
  optional KL term.
- Parameters: f32 master weights; the forward sees them through straight-through fake quantisation in
  their storage formats (FP8 e4m3 32x32 blocks with ue8m0 scales, FP4 e2m1 1x32 groups, bf16), whose
  values equal exactly what `export_params` stores with the repository's quantisers
  (`ced_jax.testing.random_weights.quantize_fp8 / quantize_fp4`), so the trained draft evaluated
  through `ced_jax.model.dspark` on the exported tensors is the draft that was trained.
- The training forward (`draft_logits`) recomputes the draft for every position of a sequence at
  once: the same arithmetic and bf16 / FP8 rounding points as `ced_jax.model.dspark` (rounding with an
  identity gradient), dense attention with a band mask standing in for each position's ring, dense
  experts masked by the routing weights (the reference's sum over the selected experts in ascending
  order, plus exact zeros). `dspark.py` itself is not differentiable (its rounding is integer bit
  arithmetic and its experts read packed FP4), hence this second forward; a test checks it against
  `dspark.draft_step`.
- Loss: cross-entropy of the teacher-forced draft logits (Markov bias of the true previous token)
  against the greedy tokens, plus `kl_weight` * KL(backbone || draft) over the same positions, plus
  `confidence_weight` * BCE of the confidence head against "the draft token at this position is the
  greedy token" (teacher-forced, i.e. given all earlier drafts accepted). The confidence head reads
  stop-gradient features, so it estimates acceptance without steering the draft.
- Acceptance (`measure_acceptance`): `dspark.draft_step` on the exported storage tensors at every
  continuation position of held-out sequences (rings filled by `dspark.insert_context` with the
  window of main_x before p); the first position's agreement and the mean accepted length (leading
  drafts equal to the greedy tokens, 0 .. B).

Known limit (measured on the tiny preset): its random backbone's greedy continuations are chaotic
(the most frequent next token of a token is right 4.4% of the time on held-out continuations, the
next token after a given token is the same only 21% of the time in training data, no cycles
within 240 tokens), so 200 steps on 96 continuations (~4k draft positions) overfit: held-out
first-position agreement 0.1-0.6% (random) -> 0.9-2.4% (trained), noise level.

Letters as in `ced_jax.model.dspark`: N sequences, T positions, P draft positions, B block, M hc streams,
D width, H heads, Dh head dim, V vocab, R Markov rank, E experts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ced_jax.checkpoint.hf_loader import INDEX_NAME
from ced_jax.checkpoint.mapping import FILE_DTYPES, STORAGE_DTYPES, hf_inventory, our_target
from ced_jax.config import ModelConfig
from ced_jax.invariant import reciprocal_sqrt, rounded_square, torch_mean_last
from ced_jax.model import dspark
from ced_jax.model.layers.common import apply_rope, f32_linear, rope_inv_freq
from ced_jax.model.layers.mhc import hc_mixes
from ced_jax.model.layers.moe import router_scores, swiglu
from ced_jax.quant import (
    dequant_fp4_weight,
    dequant_fp8_weight,
    e2m1_codes_scaled,
    e2m1_to_f32,
    exact_div,
    fp8_fake_quant,
    pow2_reciprocal,
    round_bf16,
    round_e4m3,
    split_blocks,
)
from ced_jax.testing.random_weights import AMAX_FLOOR, iter_hf_tensors, quantize_fp4, quantize_fp8
from pallas_kernels.formats import FP4_MAX, FP8_MAX, np_dequant_fp8_weight

HIGHEST = jax.lax.Precision.HIGHEST


def _optax():
    """optax, an optional dependency (the `train` extra): only draft training needs it."""
    try:
        import optax
    except ImportError:
        raise RuntimeError("DSpark draft training needs optax: pip install 'ced-jax[train]'") from None
    return optax


# ------------------------------------------------------------------------ tensor kinds
def param_kinds(cfg: ModelConfig) -> dict[str, str]:
    """Our `mtp.*` parameter path of every trainable weight -> its storage kind: "fp8" (a weight /
    scale pair, 32x32 blocks), "fp4" (stacked packed experts), "wo_a" (FP8 in the release, bf16
    dequantised in our tree), "bf16", "f32"."""
    kinds: dict[str, str] = {}
    for name, spec in hf_inventory(cfg).items():
        if spec.group != "dspark" or spec.is_scale:
            continue
        target = our_target(name)
        if target.kind == "stack":
            kinds[target.path] = "fp4"
        elif target.kind == "wo_a":
            kinds[target.path] = "wo_a"
        elif spec.quant == "fp8":
            kinds[target.path] = "fp8"
        elif spec.dtype == "BF16":
            kinds[target.path] = "bf16"
        else:
            kinds[target.path] = "f32"
    return kinds


def _get(tree: dict, path: str):
    node = tree
    for part in path.split("."):
        node = node[part]
    return node


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _weight_path(path: str) -> str:
    """'mtp.0.attn.wq_a.weight' -> 'mtp.0.attn.wq_a' (the node holding a weight / scale pair)."""
    return path[: -len(".weight")]


# ------------------------------------------------------------ masters <-> storage tensors
def master_from_storage(tree: dict, cfg: ModelConfig) -> dict[str, jax.Array]:
    """The storage tree ({'mtp': ...}, as `dspark.load_dspark_params`) -> flat f32 master weights
    {path: values}: every quantised tensor dequantised exactly."""
    block = cfg.weight_block_size
    master = {}
    for path, kind in param_kinds(cfg).items():
        if kind in ("fp8", "fp4"):
            pair = _get(tree, _weight_path(path))
            deq = dequant_fp8_weight if kind == "fp8" else dequant_fp4_weight
            args = (block,) if kind == "fp8" else ()
            master[path] = jnp.asarray(deq(jnp.asarray(pair["weight"]), jnp.asarray(pair["scale"]), *args))
        else:
            master[path] = jnp.asarray(_get(tree, path), jnp.float32)
    return master


def export_params(master: dict, cfg: ModelConfig) -> dict:
    """Flat f32 masters -> the storage tree ({'mtp': ...}) in our storage dtypes, quantised with the
    repository's quantisers: FP8 e4m3 + ue8m0 bytes (32x32 blocks), FP4 packed + ue8m0 bytes per 32
    (per expert), bf16 by round to nearest even, `wo_a` FP8-quantised then dequantised to bf16 (as the
    loader keeps it). numpy arrays."""
    block = cfg.weight_block_size
    tree: dict = {}
    for path, kind in param_kinds(cfg).items():
        w = np.asarray(master[path], np.float32)
        if kind == "fp8":
            q, s = quantize_fp8(w, block, block)
            _set(tree, _weight_path(path), {"weight": q, "scale": s})
        elif kind == "fp4":
            pairs = [quantize_fp4(w[e]) for e in range(w.shape[0])]
            _set(
                tree,
                _weight_path(path),
                {"weight": np.stack([p[0] for p in pairs]), "scale": np.stack([p[1] for p in pairs])},
            )
        elif kind == "wo_a":
            q, s = quantize_fp8(w, block, block)
            _set(tree, path, np_dequant_fp8_weight(q, s, block).astype(ml_dtypes.bfloat16))
        elif kind == "bf16":
            _set(tree, path, w.astype(ml_dtypes.bfloat16))
        else:
            _set(tree, path, w)
    return tree


def _as_bf16(arr: np.ndarray, name: str) -> np.ndarray:
    """A bf16 tensor held as bf16 or (widened on CPU) f32 -> bf16, refusing values bf16 cannot hold."""
    arr = np.asarray(arr)
    out = arr.astype(ml_dtypes.bfloat16)
    if not np.array_equal(out.astype(np.float32), arr.astype(np.float32), equal_nan=True):
        raise ValueError(f"tensor '{name}': values are not bf16-representable")
    return out


def hf_tensors(tree: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The storage tree -> the released `mtp.*` tensors {HF name: array in our storage dtype}, the
    inverse of `dspark.load_dspark_params`: experts unstacked, `attn.wo_a` back to FP8 weight + ue8m0
    scale (the canonical quantisation of the bf16 values, which are FP8 values times a power of two
    per block, so loading gives them back bit for bit). Dtypes and shapes checked against
    `mapping.hf_inventory(cfg)`."""
    block = cfg.weight_block_size
    out: dict[str, np.ndarray] = {}
    wo_a_done: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, spec in hf_inventory(cfg).items():
        if spec.group != "dspark":
            continue
        target = our_target(name)
        if target.kind == "copy":
            arr = np.asarray(_get(tree, target.path))
        elif target.kind == "stack":
            arr = np.asarray(_get(tree, target.path))[target.expert]
        else:
            if target.path not in wo_a_done:
                w = np.asarray(_get(tree, target.path)).astype(np.float32)
                q, s = quantize_fp8(w, block, block)
                if not np.array_equal(np_dequant_fp8_weight(q, s, block), w):
                    raise ValueError(f"tensor '{target.path}': not FP8 values with power-of-two block scales")
                wo_a_done[target.path] = (q, s)
            arr = wo_a_done[target.path][0 if target.kind == "wo_a" else 1]
        want = STORAGE_DTYPES[spec.dtype]
        if want == np.dtype(ml_dtypes.bfloat16):
            arr = _as_bf16(arr, name)
        elif arr.dtype != want:
            raise ValueError(f"tensor '{name}': expected {want}, got {arr.dtype}")
        if tuple(arr.shape) != tuple(spec.shape):
            raise ValueError(f"tensor '{name}': expected shape {list(spec.shape)}, got {list(arr.shape)}")
        out[name] = np.ascontiguousarray(arr)
    return out


def save_dspark_safetensors(
    tree: dict, cfg: ModelConfig, path: str | Path, *, write_index: bool = False
) -> Path:
    """Write the draft stages' storage tree as one safetensors file of released `mtp.*` tensors (names,
    dtypes F8_E4M3 / F8_E8M0 / I8 / BF16 / F32 and shapes of `mapping.hf_inventory(cfg)`, group
    "dspark"). write_index: also write `model.safetensors.index.json` next to it naming this file
    for every tensor, so `dspark.load_dspark_params(directory, cfg)` reads it back."""
    from safetensors.numpy import save_file

    path = Path(path)
    inventory = hf_inventory(cfg)
    tensors = {
        name: arr.view(FILE_DTYPES[inventory[name].dtype]) for name, arr in hf_tensors(tree, cfg).items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    if write_index:
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": {name: path.name for name in sorted(tensors)}}  # fmt: skip
        (path.parent / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return path


def random_dspark_tree(cfg: ModelConfig, seed: int) -> dict:
    """Random `mtp.*` weights by the repository's generation scheme (`random_weights`), as the storage
    tree `dspark.load_dspark_params` returns (numpy)."""
    block = cfg.weight_block_size
    flat: dict = {}
    wo_a: dict[str, dict[str, np.ndarray]] = {}
    names = [n for n, s in hf_inventory(cfg).items() if s.group == "dspark"]
    for name, arr in iter_hf_tensors(cfg, seed, names):
        target = our_target(name)
        if target.kind == "copy":
            _set(flat, target.path, arr)
        elif target.kind == "stack":
            node = _get(flat, target.path) if _has(flat, target.path) else None
            if node is None:
                node = np.empty((cfg.dspark_n_routed_experts, *arr.shape), arr.dtype)
                _set(flat, target.path, node)
            node[target.expert] = arr
        else:
            wo_a.setdefault(target.path, {})["weight" if target.kind == "wo_a" else "scale"] = arr
    for path, pair in wo_a.items():
        _set(
            flat, path, np_dequant_fp8_weight(pair["weight"], pair["scale"], block).astype(ml_dtypes.bfloat16)
        )
    return flat


def _has(tree: dict, path: str) -> bool:
    try:
        _get(tree, path)
        return True
    except (KeyError, TypeError, IndexError):
        return False


# ---------------------------------------------------------- straight-through rounding
def _straight_through(fn: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """fn's exact values forward, the identity's gradient backward."""

    @jax.custom_jvp
    def wrapped(x):
        return fn(x)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        return fn(primals[0]), tangents[0]

    return wrapped


def _pow2_ceil(x: jax.Array) -> jax.Array:
    """The smallest power of two >= positive normal f32 x, from the bits (np_ue8m0_byte_ceil's rule)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def fake_quant_fp8_weight(w: jax.Array, block: int = 32) -> jax.Array:
    """f32 [out, in] -> the values `quantize_fp8(w, block, block)` stores (dequantised), in jax."""
    out, inn = w.shape
    ob, ib = -(-out // block), -(-inn // block)
    padded = jnp.zeros((ob * block, ib * block), jnp.float32).at[:out, :inn].set(w)
    tiles = padded.reshape(ob, block, ib, block)
    amax = jnp.maximum(jnp.max(jnp.abs(tiles), axis=(1, 3)), AMAX_FLOOR)
    scale = _pow2_ceil(exact_div(amax, float(FP8_MAX)))[:, None, :, None]
    q = round_e4m3(tiles * pow2_reciprocal(scale)) * scale
    return q.reshape(padded.shape)[:out, :inn]


def fake_quant_fp4_weight(w: jax.Array) -> jax.Array:
    """f32 [..., out, in] -> the values `quantize_fp4` stores per [out, in] (dequantised), in jax."""
    groups = split_blocks(w, 32)
    amax = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), AMAX_FLOOR)
    scale = _pow2_ceil(exact_div(amax, float(FP4_MAX)))
    return (e2m1_to_f32(e2m1_codes_scaled(groups, scale)) * scale[..., None]).reshape(w.shape)


_rb = _straight_through(round_bf16)
_fq8_act = _straight_through(lambda x: fp8_fake_quant(x, 32))
_fq8_w = _straight_through(fake_quant_fp8_weight)
_fq4_w = _straight_through(fake_quant_fp4_weight)


def effective_params(master: dict, cfg: ModelConfig) -> dict:
    """Flat f32 masters -> nested {'mtp': ...} of f32 values the forward uses: each weight through
    its storage format's fake quantisation (straight-through), equal to the exported tensors' values."""
    tree: dict = {}
    for path, kind in param_kinds(cfg).items():
        w = master[path]
        if kind in ("fp8", "wo_a"):
            w = _fq8_w(w)
        elif kind == "fp4":
            w = _fq4_w(w)
        elif kind == "bf16":
            w = _rb(w)
        _set(tree, path, w)
    return tree


# ------------------------------------------------------------------- training forward
def _rms_norm(x, w, eps):
    return _rb(w * (x * reciprocal_sqrt(torch_mean_last(rounded_square(x)) + jnp.float32(eps))))


def _linear8(x, w):
    """fp8_linear over dequantised weight values: activation FP8 fake-quant, f32 GEMM, bf16 output."""
    return _rb(jnp.einsum("...k,nk->...n", _fq8_act(x), w, precision=HIGHEST))


def _collapse(x, pre):
    return _rb(jnp.sum(pre[..., None] * x, axis=-2))


def _expand(y, residual, post, comb):
    mixed = jnp.sum(comb[..., None] * residual[..., :, None, :], axis=-3)
    return _rb(post[..., None] * y[..., None, :] + mixed)


def _inv_freq(cfg: ModelConfig):
    return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)


def _window_kv(p, cfg, x, positions):
    a = p["attn"]
    kv = _rms_norm(_linear8(x, a["wkv"]["weight"]), a["kv_norm"]["weight"], cfg.rms_norm_eps)
    return _fq8_act(apply_rope(kv, positions, _inv_freq(cfg), rounding=_rb))


def _attention(p, cfg, x, ctx_kv, draft_pos):
    """x [N, P, B, D] (attn_norm output of the block of draft position p = draft_pos [P]);
    ctx_kv [N, T, Dh] window KV of main_x at every sequence position. Position p's block attends to
    the context positions p-W+1 .. p (its ring) and to all B block keys. -> [N, P, B, D]."""
    eps, inv_freq = cfg.rms_norm_eps, _inv_freq(cfg)
    n, P, b, _ = x.shape
    H, Dh, W = cfg.num_heads, cfg.head_dim, cfg.sliding_window
    positions = draft_pos[:, None] + 1 + jnp.arange(b)[None, :]  # [P, B]
    a = p["attn"]
    qr = _rms_norm(_linear8(x, a["wq_a"]["weight"]), a["q_norm"]["weight"], eps)
    q = _linear8(qr, a["wq_b"]["weight"]).reshape(n, P, b, H, Dh)
    q = apply_rope(q, jnp.broadcast_to(positions, (n, P, b))[..., None], inv_freq, rounding=_rb)
    block_kv = _window_kv(p, cfg, x, jnp.broadcast_to(positions, (n, P, b)))  # [N, P, B, Dh]
    t = jnp.arange(ctx_kv.shape[1])
    ring_mask = (t[None, :] <= draft_pos[:, None]) & (t[None, :] > draft_pos[:, None] - W)  # [P, T]
    scale = jnp.float32(Dh**-0.5)
    s_ctx = jnp.einsum("npbhd,ntd->npbht", q, ctx_kv, precision=HIGHEST) * scale
    s_ctx = jnp.where(ring_mask[None, :, None, None, :], s_ctx, -jnp.inf)
    s_blk = jnp.einsum("npbhd,npkd->npbhk", q, block_kv, precision=HIGHEST) * scale
    row_max = jnp.maximum(jnp.maximum(jnp.max(s_ctx, -1), jnp.max(s_blk, -1)), -1e30)
    row_max = jax.lax.stop_gradient(row_max)
    p_ctx = jnp.exp(s_ctx - row_max[..., None])
    p_blk = jnp.exp(s_blk - row_max[..., None])
    denom = jnp.exp(a["attn_sink"] - row_max) + jnp.sum(p_ctx, -1) + jnp.sum(p_blk, -1)
    out = jnp.einsum("npbht,ntd->npbhd", _rb(p_ctx), ctx_kv, precision=HIGHEST)
    out = out + jnp.einsum("npbhk,npkd->npbhd", _rb(p_blk), block_kv, precision=HIGHEST)
    o = _rb(exact_div(out, denom[..., None]))
    o = apply_rope(o, jnp.broadcast_to(positions, (n, P, b))[..., None], inv_freq, inverse=True, rounding=_rb)
    groups = cfg.o_groups
    o = o.reshape(n, P, b, groups, H * Dh // groups)
    wo_a = a["wo_a"]["weight"].reshape(groups, cfg.o_lora_rank, -1)
    o = _rb(jnp.einsum("npbgd,grd->npbgr", o, wo_a, precision=HIGHEST))
    return _linear8(o.reshape(n, P, b, -1), a["wo_b"]["weight"])


def _moe(p, cfg, x):
    """The stage's MoE with dense experts: every expert on every row, its hidden activation scaled by
    the routing weight (0 for experts not selected) before w2, summed in ascending expert order.
    -> (out [..., D], routing weights [..., E])."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    f = p["ffn"]
    scores = router_scores(flat, f["gate"]["weight"])
    k = cfg.dspark_num_experts_per_tok
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(scores) + f["gate"]["bias"], k)
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        chosen = exact_div(chosen, jnp.sum(chosen, axis=-1, keepdims=True) + 1e-20)
    chosen = chosen * cfg.routed_scaling_factor
    n_experts = scores.shape[-1]
    dense_w = jnp.sum(jax.nn.one_hot(ids, n_experts) * chosen[..., None], axis=-2)  # [R, E]
    ex = f["experts"]
    xq = _fq8_act(flat)
    gate = _rb(jnp.einsum("rk,enk->ren", xq, ex["w1"]["weight"], precision=HIGHEST))
    up = _rb(jnp.einsum("rk,enk->ren", xq, ex["w3"]["weight"], precision=HIGHEST))
    hidden = _rb(dense_w[..., None] * swiglu(gate, up, cfg.swiglu_limit))
    y = _rb(jnp.einsum("rek,enk->ren", _fq8_act(hidden), ex["w2"]["weight"], precision=HIGHEST))
    routed = jnp.zeros(flat.shape, jnp.float32)
    for e in range(n_experts):
        routed = routed + y[:, e]
    sh = f["shared_experts"]
    s_gate = _linear8(flat, sh["w1"]["weight"])
    s_up = _linear8(flat, sh["w3"]["weight"])
    shared = _linear8(_rb(swiglu(s_gate, s_up, cfg.swiglu_limit)), sh["w2"]["weight"])
    return _rb(routed + shared).reshape(shape), dense_w.reshape(*shape[:-1], n_experts)


def _mixes(p, site, x, cfg):
    return hc_mixes(
        x, p[f"hc_{site}_fn"], p[f"hc_{site}_scale"], p[f"hc_{site}_base"],
        hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
    )  # fmt: skip


def _stage(p, cfg, x, pre, ctx_kv, draft_pos):
    eps = cfg.rms_norm_eps
    residual = x
    attn_pre, attn_post, attn_comb = _mixes(p, "attn", x, cfg)
    a_in = _rms_norm(_collapse(x, pre), p["attn_norm"]["weight"], eps)
    x = _expand(_attention(p, cfg, a_in, ctx_kv, draft_pos), residual, attn_post, attn_comb)
    residual = x
    ffn_pre, ffn_post, ffn_comb = _mixes(p, "ffn", x, cfg)
    f_in = _rms_norm(_collapse(x, attn_pre), p["ffn_norm"]["weight"], eps)
    y, dense_w = _moe(p, cfg, f_in)
    return _expand(y, residual, ffn_post, ffn_comb), ffn_pre, dense_w


def draft_logits(
    eff: dict,
    cfg: ModelConfig,
    embed_weight: jax.Array,
    head_weight: jax.Array,
    main_hidden: jax.Array,
    tokens: jax.Array,
    draft_pos: jax.Array,
) -> dict:
    """The draft step at every position of `draft_pos` [P] of N sequences at once, teacher-forced.

    eff: `effective_params`; main_hidden [N, T, n_targets * D]; tokens [N, T] (the sequence: the
    block of position p starts with tokens[p+1], the Markov bias of draft position j uses
    tokens[p+1+j] as its previous id). Needs draft_pos + B + 1 < T for the targets.
    -> {base_logits, logits (teacher-forced Markov bias), confidence, markov_embed, head_input:
    [N, P, B, ...]; routing: per stage the dense routing weights [N, P, B, E]}."""
    stages = [eff["mtp"][str(s)] for s in range(cfg.num_nextn_predict_layers)]
    first, last = stages[0], stages[-1]
    n, t = tokens.shape
    b, eps = cfg.dspark_block_size, cfg.rms_norm_eps
    mx = _rms_norm(_linear8(main_hidden, first["main_proj"]["weight"]), first["main_norm"]["weight"], eps)
    seq_pos = jnp.broadcast_to(jnp.arange(t), (n, t))
    ctx = [_window_kv(p, cfg, mx, seq_pos) for p in stages]
    offsets = jnp.arange(b)
    inputs = tokens[:, draft_pos + 1]  # [N, P]
    ids = jnp.concatenate(
        [inputs[..., None], jnp.full((*inputs.shape, b - 1), cfg.dspark_noise_token_id, tokens.dtype)], -1
    )
    h = round_bf16(embed_weight.astype(jnp.float32)[ids])  # [N, P, B, D]
    x = jnp.broadcast_to(h[..., None, :], (*ids.shape, cfg.hc_mult, h.shape[-1]))
    pre = jnp.zeros((*ids.shape, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    routing = []
    for p, kv in zip(stages, ctx, strict=True):
        x, pre, w = _stage(p, cfg, x, pre, kv, draft_pos)
        routing.append(w)
    hin = _collapse(x, pre)
    normed = _rms_norm(hin, last["norm"]["weight"], eps)
    base = f32_linear(normed, head_weight)
    prev = tokens[:, draft_pos[:, None] + 1 + offsets[None, :]]  # [N, P, B]
    mh = last["markov_head"]
    emb = mh["embed"]["weight"][prev]
    logits = base + jnp.einsum("...r,vr->...v", emb, mh["head"]["weight"], precision=HIGHEST)
    proj = last["confidence_head"]["proj"]["weight"]
    feats = jax.lax.stop_gradient(jnp.concatenate([hin, emb], axis=-1))
    conf = jnp.einsum("...k,nk->...n", feats, proj, precision=HIGHEST)[..., 0]
    return dict(
        base_logits=base, logits=logits, confidence=conf, markov_embed=emb, head_input=hin, routing=routing
    )


# ------------------------------------------------------------------------- data
@dataclass
class Continuations:
    """Greedy continuations of the frozen backbone: tokens [N, T] (prompt then greedy tokens),
    main_hidden [N, T, n_targets * D] (f32 holding bf16 values) at every position, backbone_logits
    [N, T, V] (position q's logits predict tokens[q+1]), prompt_len (the same for every row)."""

    tokens: np.ndarray
    main_hidden: np.ndarray
    backbone_logits: np.ndarray
    prompt_len: int

    def rows(self, index) -> Continuations:
        return Continuations(
            self.tokens[index], self.main_hidden[index], self.backbone_logits[index], self.prompt_len
        )


def random_prompts(cfg: ModelConfig, n: int, length: int, seed: int, first_id: int = 14) -> np.ndarray:
    """[n, length] ids drawn uniformly from first_id .. vocab-1 (the tiny tokenizer's 14 special
    tokens are 0 .. 13): varied prompts, a different continuation from each."""
    if length < 1 or n < 1:
        raise ValueError(f"prompts: need n >= 1 and length >= 1, got {n}, {length}")
    return np.random.default_rng(seed).integers(first_id, cfg.vocab_size, (n, length)).astype(np.int32)


def greedy_continuations(
    model, cfg: ModelConfig, prompts: np.ndarray, continuation_tokens: int, *, session_batch: int = 16
) -> Continuations:
    """Prefill each prompt, then feed the backbone's greedy token back `continuation_tokens` - 1 times,
    capturing the blocks' outputs at every step (`Session.step(capture_blocks=True)`). Rows run
    `session_batch` at a time (the last batch padded by repeating its first prompt)."""
    prompts = np.asarray(prompts, np.int32)
    if prompts.ndim != 2:
        raise ValueError(f"prompts: expected [N, T] ids, got shape {list(prompts.shape)}")
    if continuation_tokens < cfg.dspark_block_size + 2:
        raise ValueError(
            f"continuation_tokens: need at least dspark_block_size + 2 = {cfg.dspark_block_size + 2}, "
            f"got {continuation_tokens}"
        )
    n, tp = prompts.shape
    total = tp + continuation_tokens
    toks, hids, logs = [], [], []
    for start in range(0, n, session_batch):
        chunk = prompts[start : start + session_batch]
        rows = chunk.shape[0]
        if rows < session_batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], session_batch - rows, 0)])
        session = model.new_session(session_batch, total)
        logits, aux = session.step(chunk, capture_blocks=True)
        seq, hid, lg = (
            [chunk],
            [np.asarray(dspark.main_hidden(cfg, jnp.asarray(aux["block_output"])))],
            [logits],
        )
        nxt = logits[:, -1].argmax(-1).astype(np.int32)
        for _ in range(continuation_tokens - 1):
            seq.append(nxt[:, None])
            logits, aux = session.step(nxt[:, None], capture_blocks=True)
            hid.append(np.asarray(dspark.main_hidden(cfg, jnp.asarray(aux["block_output"]))))
            lg.append(logits)
            nxt = logits[:, -1].argmax(-1).astype(np.int32)
        seq.append(nxt[:, None])  # the last greedy token: a target, never fed
        toks.append(np.concatenate(seq, 1)[:rows])
        hids.append(np.concatenate(hid, 1)[:rows])
        logs.append(np.concatenate(lg, 1)[:rows])
    tokens = np.concatenate(toks)
    # The last token has no main_hidden / logits (it was never fed): pad with zeros, never used.
    hidden = np.concatenate(hids)
    hidden = np.concatenate([hidden, np.zeros_like(hidden[:, :1])], 1)
    logits = np.concatenate(logs)
    logits = np.concatenate([logits, np.zeros_like(logits[:, :1])], 1)
    return Continuations(tokens, hidden.astype(np.float32), logits.astype(np.float32), tp)


def draft_positions(cfg: ModelConfig, prompt_len: int, length: int) -> np.ndarray:
    """Positions p at which a draft step is trained / measured: the block's input tokens[p+1] is a
    greedy token (p >= prompt_len - 1) and all B targets tokens[p+2 .. p+B+1] exist."""
    last = length - cfg.dspark_block_size - 2
    if last < prompt_len - 1:
        raise ValueError(
            f"sequences of {length} tokens leave no draft position after a {prompt_len}-token prompt"
        )
    return np.arange(prompt_len - 1, last + 1, dtype=np.int32)


# ------------------------------------------------------------------------- loss
def loss_terms(
    eff: dict,
    cfg: ModelConfig,
    embed_weight,
    head_weight,
    main_hidden,
    tokens,
    backbone_logits,
    draft_pos,
    *,
    kl_weight: float,
    confidence_weight: float,
):
    out = draft_logits(eff, cfg, embed_weight, head_weight, main_hidden, tokens, draft_pos)
    b = cfg.dspark_block_size
    tpos = draft_pos[:, None] + 2 + jnp.arange(b)[None, :]  # [P, B]
    targets = tokens[:, tpos]
    logp = jax.nn.log_softmax(out["logits"], axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])
    teacher = jax.nn.softmax(backbone_logits[:, tpos - 1], axis=-1)
    kl = jnp.mean(jnp.sum(teacher * (jnp.log(teacher + 1e-30) - logp), axis=-1))
    correct = (jnp.argmax(out["logits"], axis=-1) == targets).astype(jnp.float32)
    bce = jnp.mean(_optax().sigmoid_binary_cross_entropy(out["confidence"], jax.lax.stop_gradient(correct)))
    loss = ce + kl_weight * kl + confidence_weight * bce
    metrics = {"loss": loss, "ce": ce, "kl": kl, "bce": bce, "first_agree_tf": jnp.mean(correct[..., 0]),
               "agree_tf": jnp.mean(correct)}  # fmt: skip
    return loss, metrics


# ------------------------------------------------------------------------- acceptance
def measure_acceptance(
    tree: dict, cfg: ModelConfig, embed_weight, head_weight, data: Continuations, *, rows_per_call: int = 256
) -> dict:
    """`dspark.draft_step` on the storage tree at every draft position of every sequence of `data`:
    rings hold main_x of positions p-W+1 .. p (`insert_context`, then the step's own insertion of p),
    the input id is tokens[p+1], the drafts are compared with tokens[p+2 .. p+B+1].
    -> {first_agreement, mean_accepted (leading drafts accepted, 0 .. B), per_position (agreement at
    each draft position given all earlier accepted), confidence_mean, drafts}."""
    params = jax.tree.map(jnp.asarray, tree)
    b, W = cfg.dspark_block_size, cfg.sliding_window
    pos = draft_positions(cfg, data.prompt_len, data.tokens.shape[1])
    n = data.tokens.shape[0]
    seq_idx = np.repeat(np.arange(n), len(pos))
    p_idx = np.tile(pos, n)
    tokens = jnp.asarray(data.tokens)
    hidden = jnp.asarray(data.main_hidden)

    @jax.jit
    def run(params, seq, p):
        mx_all = dspark.main_x(params, cfg, hidden[seq])  # [R, T, D]
        start = jnp.maximum(p - (W - 1), 0)
        window = start[:, None] + jnp.arange(W - 1)[None, :]
        mx_win = jnp.take_along_axis(mx_all, jnp.minimum(window, mx_all.shape[1] - 1)[..., None], axis=1)
        rings = dspark.empty_rings(cfg, seq.shape[0])
        rings = dspark.insert_context(params, cfg, rings, mx_win, start, p - start)
        mx_p = jnp.take_along_axis(mx_all, p[:, None, None], axis=1)[:, 0]
        out, _ = dspark.draft_step(params, cfg, embed_weight, head_weight, rings, mx_p, tokens[seq, p + 1], p)
        return out.draft_ids[:, 1:], out.confidence

    drafts, confs = [], []
    for s in range(0, len(seq_idx), rows_per_call):
        seq = seq_idx[s : s + rows_per_call]
        p = p_idx[s : s + rows_per_call]
        pad = rows_per_call - len(seq)
        d, c = run(
            params,
            jnp.asarray(np.pad(seq, (0, pad))),
            jnp.asarray(np.pad(p, (0, pad), constant_values=pos[0])),
        )
        drafts.append(np.asarray(d)[: len(seq)])
        confs.append(np.asarray(c)[: len(seq)])
    drafts = np.concatenate(drafts)
    confs = np.concatenate(confs)
    targets = data.tokens[seq_idx[:, None], p_idx[:, None] + 2 + np.arange(b)[None, :]]
    match = drafts == targets
    accepted = np.cumprod(match, axis=1)
    per_position = [float(match[accepted[:, j - 1] == 1, j].mean()) if j and accepted[:, j - 1].any()
                    else float(match[:, 0].mean()) if j == 0 else 0.0 for j in range(b)]  # fmt: skip
    return {
        "rows": int(len(seq_idx)),
        "first_agreement": float(match[:, 0].mean()),
        "mean_accepted": float(accepted.sum(1).mean()),
        "per_position": per_position,
        "confidence_mean": float((1 / (1 + np.exp(-confs))).mean()),
        "drafts": drafts,
        "confidence": confs,
        "accepted": accepted,
    }


# ------------------------------------------------------------------------- training
@dataclass
class TrainLog:
    steps: int
    seconds: float
    data_seconds: float
    history: list[dict]
    before: dict | None
    after: dict | None

    def summary(self) -> dict:
        def short(m):
            return (
                None
                if m is None
                else {
                    k: m[k]
                    for k in ("rows", "first_agreement", "mean_accepted", "per_position", "confidence_mean")
                }
            )

        return {
            "steps": self.steps,
            "train_seconds": round(self.seconds, 1),
            "data_seconds": round(self.data_seconds, 1),
            "loss_first": self.history[0]["loss"] if self.history else None,
            "loss_last": self.history[-1]["loss"] if self.history else None,
            "before": short(self.before),
            "after": short(self.after),
        }


def backbone_embed_head(model) -> tuple[jax.Array, jax.Array]:
    return model.params["embed"]["weight"], model.params["head"]["weight"]


def distill(
    model,
    *,
    cfg: ModelConfig | None = None,
    init_tree: dict | None = None,
    prompts: np.ndarray | None = None,
    heldout_prompts: np.ndarray | None = None,
    n_prompts: int = 64,
    n_heldout: int = 16,
    prompt_len: int = 16,
    continuation_tokens: int = 48,
    steps: int = 300,
    batch: int = 8,
    learning_rate: float = 3e-3,
    seed: int = 0,
    kl_weight: float = 0.5,
    confidence_weight: float = 0.1,
    session_batch: int = 16,
    measure: bool = True,
    log_every: int = 25,
    data: Continuations | None = None,
    heldout: Continuations | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, TrainLog]:
    """Self-distil the draft stages of `model` (a `ced_jax.Model`, the backbone frozen) on its own
    greedy continuations. -> (the trained `mtp` storage tree {'mtp': ...} (numpy, as
    `dspark.load_dspark_params` returns), TrainLog).

    cfg: the config with the DSpark fields (default model.cfg); init_tree: the starting storage tree
    (default model.params' 'mtp'). prompts [N, T] (default `random_prompts(n_prompts, prompt_len)`
    from `seed`), held-out prompts likewise from seed + 1 (`n_heldout` of them) for the acceptance
    measured before and after (`measure`). data / heldout: ready-made continuations instead.
    Adam (optax.adamw, no decay) with a cosine schedule over `steps`, minibatches of `batch`
    sequences drawn with `seed`."""
    cfg = cfg or model.cfg
    if cfg.num_nextn_predict_layers <= 0 or cfg.dspark_block_size <= 0:
        raise ValueError(
            "config: the model has no DSpark stages (num_nextn_predict_layers / dspark_block_size)"
        )
    for name, value in (("steps", steps), ("batch", batch), ("continuation_tokens", continuation_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    say = progress or (lambda _msg: None)
    if init_tree is None:
        if "mtp" not in model.params:
            raise ValueError("model has no DSpark parameters (model.params['mtp']); pass init_tree")
        init_tree = {"mtp": model.params["mtp"]}
    embed_w, head_w = backbone_embed_head(model)
    t0 = time.perf_counter()
    if data is None:
        if prompts is None:
            prompts = random_prompts(cfg, n_prompts, prompt_len, seed)
        say(f"generating {len(prompts)} training continuations of {continuation_tokens} tokens")
        data = greedy_continuations(model, cfg, prompts, continuation_tokens, session_batch=session_batch)
    if measure and heldout is None:
        if heldout_prompts is None:
            heldout_prompts = random_prompts(cfg, n_heldout, data.prompt_len, seed + 1)
        say(f"generating {len(heldout_prompts)} held-out continuations")
        heldout = greedy_continuations(
            model, cfg, heldout_prompts, data.tokens.shape[1] - data.prompt_len, session_batch=session_batch
        )
    data_seconds = time.perf_counter() - t0

    init_storage = _numpy_storage(init_tree, cfg)
    before = measure_acceptance(init_storage, cfg, embed_w, head_w, heldout) if measure else None
    if before is not None:
        say(f"before: first-position agreement {before['first_agreement']:.3f}, "
            f"mean accepted {before['mean_accepted']:.3f}")  # fmt: skip

    master = master_from_storage(init_storage, cfg)
    optax = _optax()
    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = opt.init(master)
    pos = jnp.asarray(draft_positions(cfg, data.prompt_len, data.tokens.shape[1]))
    tokens_all = jnp.asarray(data.tokens)
    hidden_all = jnp.asarray(data.main_hidden)
    logits_all = jnp.asarray(data.backbone_logits)

    def loss_fn(master, idx):
        eff = effective_params(master, cfg)
        return loss_terms(
            eff, cfg, embed_w, head_w, hidden_all[idx], tokens_all[idx], logits_all[idx], pos,
            kl_weight=kl_weight, confidence_weight=confidence_weight,
        )  # fmt: skip

    @jax.jit
    def train_step(master, opt_state, idx):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(master, idx)
        updates, opt_state = opt.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state, metrics

    rng = np.random.default_rng(seed + 2)
    n = data.tokens.shape[0]
    history = []
    t1 = time.perf_counter()
    for step in range(steps):
        idx = jnp.asarray(rng.choice(n, size=min(batch, n), replace=False))
        master, opt_state, metrics = train_step(master, opt_state, idx)
        if step % log_every == 0 or step == steps - 1:
            row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
            history.append(row)
            say(f"step {step}: loss {row['loss']:.4f} ce {row['ce']:.4f} kl {row['kl']:.4f} "
                f"bce {row['bce']:.4f} first-agree(tf) {row['first_agree_tf']:.3f}")  # fmt: skip
    train_seconds = time.perf_counter() - t1
    trained = export_params(master, cfg)
    after = measure_acceptance(trained, cfg, embed_w, head_w, heldout) if measure else None
    if after is not None:
        say(f"after: first-position agreement {after['first_agreement']:.3f}, "
            f"mean accepted {after['mean_accepted']:.3f}")  # fmt: skip
    return trained, TrainLog(steps, train_seconds, data_seconds, history, before, after)


def _numpy_storage(tree: dict, cfg: ModelConfig) -> dict:
    """A storage tree as numpy in the storage dtypes (bf16 widened to f32 on CPU narrowed back)."""
    kinds = param_kinds(cfg)
    out: dict = {}
    for path, kind in kinds.items():
        if kind in ("fp8", "fp4"):
            pair = _get(tree, _weight_path(path))
            _set(
                out,
                _weight_path(path),
                {"weight": np.asarray(pair["weight"]), "scale": np.asarray(pair["scale"])},
            )
        elif kind in ("bf16", "wo_a"):
            _set(out, path, _as_bf16(np.asarray(_get(tree, path)), path))
        else:
            _set(out, path, np.asarray(_get(tree, path), np.float32))
    return out


def tiny_dspark_fields() -> dict:
    """The DSpark fields of the embedded tiny preset once it has stages (kept here until the preset's
    config.json carries them; `dataclasses.replace(preset('tiny'), **tiny_dspark_fields())`)."""
    return dict(
        num_nextn_predict_layers=2,
        dspark_block_size=4,
        dspark_target_layer_ids=(5, 6, 7),
        dspark_markov_rank=32,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )


__all__: Sequence[str] = (
    "Continuations",
    "TrainLog",
    "distill",
    "draft_logits",
    "effective_params",
    "export_params",
    "greedy_continuations",
    "hf_tensors",
    "master_from_storage",
    "measure_acceptance",
    "random_dspark_tree",
    "random_prompts",
    "save_dspark_safetensors",
)
