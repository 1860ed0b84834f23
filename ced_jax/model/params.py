"""The one abstract parameter tree of the model: every parameter's shape, storage dtype and logical
sharding axes (`ParamSpec`), named as the released checkpoint names it ('layers.3.attn.wq_a.weight'
is params['layers']['3']['attn']['wq_a']['weight']). Shardings, loading and the kernels' layouts
derive from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ced_jax.config import ModelConfig
from ced_jax.model.layers.moe import EXPERT_AXES
from ced_jax.trees import flatten

FP8 = ml_dtypes.float8_e4m3fn
E8M0 = np.uint8  # raw ue8m0 exponent bytes
FP4X2 = np.uint8  # two e2m1 codes per byte, low nibble first
BF16 = ml_dtypes.bfloat16
F32 = np.float32


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # logical axis names (see ced_jax.sharding)


def _fp8_linear(out_dim: int, in_dim: int, axes: tuple[str | None, str | None], block: int) -> dict:
    cdiv = lambda a: -(-a // block)
    return {
        "weight": ParamSpec((out_dim, in_dim), FP8, axes),
        "scale": ParamSpec((cdiv(out_dim), cdiv(in_dim)), E8M0, (None, None)),
    }


def _block(cfg: ModelConfig, n_experts: int) -> dict:
    """What every block has, a backbone layer or a DSpark stage: attention projections, norms, mHC,
    router, routed and shared experts."""
    D, hd, ql = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    H, G, R = cfg.num_heads, cfg.o_groups, cfg.o_lora_rank
    F, blk = cfg.moe_intermediate_size, cfg.weight_block_size
    M, mix = cfg.hc_mult, cfg.mix_hc
    norm = lambda n: {"weight": ParamSpec((n,), BF16, (None,))}
    attn = {
        "wq_a": _fp8_linear(ql, D, (None, "embed"), blk),
        "q_norm": norm(ql),
        "wq_b": _fp8_linear(H * hd, ql, ("q_heads", None), blk),
        "wkv": _fp8_linear(hd, D, (None, "embed"), blk),
        "kv_norm": norm(hd),
        "wo_a": {"weight": ParamSpec((G * R, H * hd // G), BF16, ("o_groups", None))},
        "wo_b": _fp8_linear(D, G * R, ("embed", "o_groups"), blk),
        "attn_sink": ParamSpec((H,), F32, ("q_heads",)),
    }
    expert = lambda out_dim, in_dim: {
        "weight": ParamSpec((n_experts, out_dim, in_dim // 2), FP4X2, EXPERT_AXES),
        "scale": ParamSpec((n_experts, out_dim, in_dim // 32), E8M0, EXPERT_AXES),
    }
    ffn = {
        "gate": {
            "weight": ParamSpec((n_experts, D), BF16, (None, "embed")),
            "bias": ParamSpec((n_experts,), F32, (None,)),
            "bias_vl": ParamSpec((n_experts,), F32, (None,)),
        },
        "experts": {"w1": expert(F, D), "w3": expert(F, D), "w2": expert(D, F)},
        "shared_experts": {
            "w1": _fp8_linear(F, D, ("mlp", "embed"), blk),
            "w3": _fp8_linear(F, D, ("mlp", "embed"), blk),
            "w2": _fp8_linear(D, F, ("embed", "mlp"), blk),
        },
    }
    block = {"attn": attn, "ffn": ffn, "attn_norm": norm(D), "ffn_norm": norm(D)}
    for site in ("attn", "ffn"):
        block[f"hc_{site}_fn"] = ParamSpec((mix, M * D), F32, (None, None))
        block[f"hc_{site}_base"] = ParamSpec((mix,), F32, (None,))
        block[f"hc_{site}_scale"] = ParamSpec((3,), F32, (None,))
    return block


def param_specs(cfg: ModelConfig, *, engram_tables: bool = True) -> dict:
    """The backbone's nested parameter tree (the DSpark stages: `dspark_param_specs`; the vision
    tower: `ced_jax.vision.params`). engram_tables=False: without the Engram tables
    (`layers.{i}.engram.embed`), the tree of a model whose tables stay on the host."""
    D, hd, ql, blk = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank, cfg.weight_block_size
    norm = lambda n: {"weight": ParamSpec((n,), BF16, (None,))}
    layers = {}
    for i in range(cfg.num_layers):
        layer = _block(cfg, cfg.n_routed_experts)
        attn = layer["attn"]
        if i in cfg.kv_source_layer_ids:
            comp = {"wkv": {"weight": ParamSpec((hd, D), BF16, (None, "embed"))}, "norm": norm(hd)}
            if cfg.compress_ratios[i] > 1:
                comp["wgate"] = {"weight": ParamSpec((hd, D), BF16, (None, "embed"))}
            attn["compressor"] = comp
        if i in cfg.index_source_layer_ids:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            idx = {
                "wq_b": _fp8_linear(ih * idim, ql, ("index_heads", None), blk),
                "weights_proj": {"weight": ParamSpec((ih, D), BF16, ("index_heads", "embed"))},
            }
            if i in cfg.kv_source_layer_ids:
                idx["wk"] = {"weight": ParamSpec((idim, hd), BF16, (None, None))}
                idx["k_norm"] = norm(idim)
            attn["indexer"] = idx
        if i in cfg.engram_layer_ids:
            k = cfg.engram_layer_ids.index(i)
            rows, ehd, M = cfg.engram_num_embeddings[k], cfg.engram_head_dim, cfg.hc_mult
            layer["engram"] = {
                **(
                    {
                        "embed": {
                            "weight": ParamSpec((rows, ehd), FP8, ("engram_rows", None)),
                            "scale": ParamSpec((rows, ehd // 32), E8M0, ("engram_rows", None)),
                        }
                    }
                    if engram_tables
                    else {}
                ),
                "wkv": _fp8_linear(D * (M + 1), cfg.engram_hash_cols * ehd, (None, None), blk),
                "q_weight": ParamSpec((M, D), BF16, (None, "embed")),
                "k_weight": ParamSpec((M, D), BF16, (None, "embed")),
            }
        layers[str(i)] = layer
    return {
        "embed": {"weight": ParamSpec((cfg.vocab_size, D), BF16, ("vocab", "embed"))},
        "layers": layers,
        "norm": norm(D),
        "head": {"weight": ParamSpec((cfg.vocab_size, D), BF16, ("vocab", "embed"))},
    }


def _replicated(tree):
    if isinstance(tree, ParamSpec):
        return ParamSpec(tree.shape, tree.dtype, (None,) * len(tree.shape))
    return {k: _replicated(v) for k, v in tree.items()}


def dspark_param_specs(cfg: ModelConfig) -> dict:
    """The DSpark stages' tree, {"mtp": {stage: ...}} (spec 5.2): SWA-only blocks over their own expert
    set; stage 0 also projects the target layers' hidden states, the last stage holds the final norm
    and the Markov / confidence heads. Replicated: the stages are small, every device holds them.
    Empty without stages."""
    n = cfg.num_nextn_predict_layers
    if n <= 0:
        return {}
    D, V, r, blk = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.weight_block_size
    norm = lambda dim: {"weight": ParamSpec((dim,), BF16, (None,))}
    bf16 = lambda *shape: {"weight": ParamSpec(shape, BF16, (None,) * len(shape))}
    stages = {str(k): _block(cfg, cfg.dspark_n_routed_experts) for k in range(n)}
    stages["0"]["main_proj"] = _fp8_linear(D, len(cfg.dspark_target_layer_ids) * D, (None, None), blk)
    stages["0"]["main_norm"] = norm(D)
    last = stages[str(n - 1)]
    last["norm"] = norm(D)
    last["markov_head"] = {"embed": bf16(V, r), "head": bf16(V, r)}
    last["confidence_head"] = {"proj": bf16(1, D + r)}
    return {"mtp": _replicated(stages)}


def flatten_specs(tree: dict, prefix: str = "") -> dict[str, ParamSpec]:
    """{dotted name: ParamSpec} of a spec tree (`ced_jax.trees.flatten`)."""
    return flatten(tree, prefix)
