"""`describe`: what a config amounts to (sizes, active parameters, KV bytes), from the layout alone."""

from __future__ import annotations

import math
from functools import partial

import jax

from ced_jax import cache as cache_lib
from ced_jax.checkpoint.mapping import hf_inventory, parameter_counts
from ced_jax.config import ModelConfig


def describe(cfg: ModelConfig) -> dict:
    """Config summary, parameter counts, active parameters per token, KV bytes: all from the layout."""
    counts = parameter_counts(cfg)
    inventory = hf_inventory(cfg)
    E, X = cfg.n_routed_experts, cfg.num_experts_per_tok

    def layer_active(i: int) -> float:
        total = 0.0
        for name, spec in inventory.items():
            if spec.group != "backbone" or not name.startswith(f"layers.{i}."):
                continue
            n = spec.params
            total += n * X / E if ".ffn.experts." in name else n
        return total

    head = math.prod(inventory["head.weight"].shape)
    decode_active = sum(layer_active(i) for i in range(cfg.num_layers)) + head
    # The causal encoder path of a prompt token: the layers below the first ratio-1 KV source, plus
    # that source's KV projection (its compressor and index-key projection).
    decoder_start = min(
        (s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 1), default=cfg.num_layers
    )
    kv_projection = sum(
        spec.params
        for name, spec in inventory.items()
        if name.startswith(f"layers.{decoder_start}.attn.compressor.")
        or name.startswith(f"layers.{decoder_start}.attn.indexer.wk")
        or name.startswith(f"layers.{decoder_start}.attn.indexer.k_norm")
    )
    prompt_active = sum(layer_active(i) for i in range(decoder_start)) + kv_projection
    # KV sizes are read off the serving cache's own buffers (shapes only, nothing allocated): one
    # slot, one page of the smallest size that holds whole entries of every KV source.
    page = math.lcm(*(cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids))
    state = jax.eval_shape(partial(cache_lib.init_paged_cache, cfg, max_slots=1, page_size=page, num_pages=1))
    return {
        "model": cfg.name,
        "config": {
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "routed_experts": E,
            "experts_per_token": X,
            "layer_kinds": list(cfg.layer_kinds),
            "compress_ratios": list(cfg.compress_ratios[: cfg.num_layers]),
            "kv_source_layers": list(cfg.kv_source_layer_ids),
            "index_source_layers": list(cfg.index_source_layer_ids),
            "engram_layers": list(cfg.engram_layer_ids),
            "sliding_window": cfg.sliding_window,
            "max_position_embeddings": cfg.max_position_embeddings,
            "dspark_stages": cfg.num_nextn_predict_layers,
            "vision": cfg.vision is not None,
        },
        "parameters": {
            "backbone": counts["backbone"],
            "engram_tables": counts["engram_table"],
            "dspark": counts["dspark"],
            "vision": counts["vision"],
            "total": counts["total"],
        },
        "active_parameters_per_token": {
            "prompt_encoder_path": int(round(prompt_active)),
            "decode_path": int(round(decode_active)),
        },
        "kv_bytes_per_token": cache_lib.kv_bytes_per_token(state),
        "swa_bytes_per_sequence": cache_lib.buffer_bytes(state.window),
        "storage_bytes": {"weights": sum(spec.nbytes for spec in inventory.values())},
    }
