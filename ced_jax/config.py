"""ModelConfig: the one frozen description of a DeepSeek-V4.1 model, read from the HF `config.json`.

The released config is nested (`text_config`, `vision_config`, `quantization_config`). Every key
the release carries is either mapped to a field here or listed as accepted-and-ignored with a
reason; anything else is an error naming the key, so a new checkpoint revision cannot be loaded
with silently wrong semantics.

Runtime knobs (cache sizes, mesh, buckets) never live here; see `serving.config.ServeConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

LayerKind = Literal["swa", "full", "reindex", "reuse"]


class ConfigError(ValueError):
    """A config.json that does not describe a model we can run exactly."""


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None = None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # --- vocabulary and special ids
    vocab_size: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    # --- trunk
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    # --- attention (latent MQA: one shared 512-d K=V head)
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    rope_original_max_position: int
    rope_beta_fast: float
    rope_beta_slow: float
    # --- CSA2 sparse attention
    compress_ratios: tuple[int, ...]  # one per backbone layer, then one per DSpark stage
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int  # -1: no candidate pool
    candidate_topk_blocks: int
    candidate_block_size: int
    # --- MoE
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    swiglu_limit: float
    # --- mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # --- Engram
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_vocab_size: int = 0
    engram_compressed_vocab_size: int = 0
    engram_pad_token_id: int = 2
    # --- DSpark draft stages (stored under mtp.*; recognised, not yet executed)
    num_nextn_predict_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # --- storage formats
    weight_block_size: int = 32  # FP8 dense weights: square blocks with one ue8m0 scale each
    expert_dtype: str = "fp4"
    vision: VisionConfig | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self._check_ranges()
        L = self.num_layers
        if len(self.compress_ratios) < L:
            raise ConfigError(
                f"compress_ratios: expected at least num_hidden_layers={L} entries, "
                f"got {len(self.compress_ratios)}"
            )
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            for i in getattr(self, name):
                if not 0 <= i < L:
                    raise ConfigError(f"{name}: layer {i} is outside [0, {L})")
        for i in self.kv_source_layer_ids:
            if self.compress_ratios[i] <= 0:
                raise ConfigError(f"kv_source_layer_ids: layer {i} has compress ratio 0")
            if i not in self.index_source_layer_ids:
                raise ConfigError(f"kv_source_layer_ids: layer {i} is not an index source")
        for i in range(L):
            r = self.compress_ratios[i]
            if r > 0 and self.kv_source_of(i) is None:
                raise ConfigError(f"compress_ratios: layer {i} has ratio {r} but no KV source at or above it")
            if r > 0 and self.compress_ratios[self.kv_source_of(i)] != r:
                raise ConfigError(f"compress_ratios: layer {i} has ratio {r}, its KV source a different one")
        if self.head_dim % 32 or self.index_head_dim % 32:
            raise ConfigError("head_dim and index_head_dim must be multiples of 32 (FP8/FP4 blocks)")
        if self.num_heads % self.o_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not divisible by o_groups={self.o_groups}"
            )
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError("engram_num_embeddings must have one entry per engram layer")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func: only 'sqrtsoftplus' is implemented, got {self.scoring_func!r}")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts: expected 1, got {self.n_shared_experts}")
        if self.expert_dtype != "fp4":
            raise ConfigError(f"expert_dtype: only 'fp4' is supported, got {self.expert_dtype!r}")

    def _check_ranges(self) -> None:
        """Every value within the range the model can run with, named as config.json names it."""

        def fail(field_name: str, need: str) -> None:
            key = _HF_NAME.get(field_name, field_name)
            raise ConfigError(f"{key}: {need}, got {getattr(self, field_name)!r}")

        for f in _AT_LEAST_ONE:
            if getattr(self, f) < 1:
                fail(f, "must be >= 1")
        for f in _AT_LEAST_ZERO:
            if getattr(self, f) < 0:
                fail(f, "must be >= 0")
        for f in _POSITIVE_FLOATS:
            v = getattr(self, f)
            if not (math.isfinite(v) and v > 0):
                fail(f, "must be a finite number > 0")
        for f in _FINITE_FLOATS:
            if not math.isfinite(getattr(self, f)):
                fail(f, "must be a finite number")
        if self.swiglu_limit < 0:
            fail("swiglu_limit", "must be >= 0 (0: no clamp)")
        for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, f) < self.vocab_size:
                fail(f, f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"must be <= n_routed_experts={self.n_routed_experts}")
        if self.rope_head_dim > self.head_dim:
            fail("rope_head_dim", f"must be <= head_dim={self.head_dim}")
        if self.rope_head_dim % 2:
            fail("rope_head_dim", "must be even (rotary pairs)")
        if not -1 <= self.candidate_source_layer_id < self.num_layers:
            fail("candidate_source_layer_id", f"must be -1 (none) or a layer in [0, {self.num_layers})")
        for r in self.compress_ratios:
            if r < 0:
                raise ConfigError(f"compress_ratios: must be >= 0 each, got {list(self.compress_ratios)}")
        for n in self.engram_num_embeddings:
            if n < 1:
                raise ConfigError(
                    f"engram_num_embeddings: must be >= 1 each, got {list(self.engram_num_embeddings)}"
                )
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            fail(
                "dspark_num_experts_per_tok",
                f"must be <= dspark_n_routed_experts={self.dspark_n_routed_experts}",
            )

    # ------------------------------------------------------------------ derived layout
    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed cache `layer` attends to (the latest at or above it)."""
        if self.compress_ratios[layer] == 0:
            return None
        owners = [s for s in self.kv_source_layer_ids if s <= layer]
        return max(owners) if owners else None

    def index_source_of(self, layer: int) -> int | None:
        """The index-source layer whose top-k `layer` uses (the latest at or above it)."""
        if self.compress_ratios[layer] == 0:
            return None
        owners = [s for s in self.index_source_layer_ids if s <= layer]
        return max(owners) if owners else None

    def layer_kind(self, layer: int) -> LayerKind:
        if self.compress_ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    def uses_candidates(self, layer: int) -> bool:
        """Reindex layers below the candidate source score only inside its candidate pool."""
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids

    @property
    def ced_boundary(self) -> int:
        """The first decoder layer of the causal encoder-decoder split (spec 4.2): layer L/2, which must
        be the last KV source (the decoder layers read only its compressed entries, and its compressor
        input is a function of the encoder's output). CED prefill runs the layers below it, plus its
        compressed-KV projection, over the whole prompt and the layers from it only over the prompt's
        last window. Raises ConfigError for a config without that layout."""
        boundary = self.num_layers // 2
        if boundary not in self.kv_source_layer_ids or max(self.kv_source_layer_ids) != boundary:
            raise ConfigError(
                f"CED prefill needs layer {boundary} (num_layers / 2) to be the last KV source, "
                f"got kv_source_layer_ids {list(self.kv_source_layer_ids)}"
            )
        return boundary

    @property
    def ced_boundary_or_none(self) -> int | None:
        """`ced_boundary`, or None for a config without the CED layout (every prompt then runs every
        layer)."""
        try:
            return self.ced_boundary
        except ConfigError:
            return None

    @property
    def engram_hash_cols(self) -> int:
        """Table rows fetched per position and engram layer: (n-gram sizes 2..N) x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    # ------------------------------------------------------------------ HF round trip
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, name: str = "custom") -> ModelConfig:
        return _from_hf(cfg, name=name)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ModelConfig:
        path = Path(directory) / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return _from_hf(raw, name=Path(directory).name)

    def to_hf_dict(self) -> dict[str, Any]:
        return _to_hf(self)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- HF key tables
# text_config key -> ModelConfig field. Values pass through `_convert` below.
_TEXT_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "moe_intermediate_size": "moe_intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "swiglu_limit": "swiglu_limit",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "scoring_func": "scoring_func",
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor",
    "sliding_window": "sliding_window",
    "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta",
    "kv_source_layer_ids": "kv_source_layer_ids",
    "index_source_layer_ids": "index_source_layer_ids",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "num_nextn_predict_layers": "num_nextn_predict_layers",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_num_experts_per_tok",
}
_HF_NAME = {ours: hf for hf, ours in _TEXT_KEYS.items()}
_AT_LEAST_ONE = (
    "vocab_size", "hidden_size", "num_layers", "max_position_embeddings", "num_heads", "head_dim",
    "rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "rope_original_max_position",
    "index_n_heads", "index_head_dim", "index_topk", "candidate_block_size", "moe_intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "engram_max_ngram_size",
    "weight_block_size",
)  # fmt: skip
_AT_LEAST_ZERO = (
    "image_token_id", "candidate_topk_blocks", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
    "engram_compressed_vocab_size", "engram_pad_token_id", "num_nextn_predict_layers", "dspark_block_size",
    "dspark_noise_token_id", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
)  # fmt: skip
_POSITIVE_FLOATS = (
    "rms_norm_eps",
    "rope_theta",
    "compress_rope_theta",
    "rope_factor",
    "routed_scaling_factor",
    "hc_eps",
)
_FINITE_FLOATS = ("rope_beta_fast", "rope_beta_slow", "swiglu_limit")
# text_config keys that are accepted only with the value the model is built for.
_TEXT_FIXED: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "num_key_value_heads": 1,  # one shared latent K=V head
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
}
# text_config keys with no effect on inference.
_TEXT_IGNORED = {"attention_dropout", "initializer_range", "use_cache", "torch_dtype", "dtype"}
_TOP_KEYS = {"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"}
_TOP_FIXED = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"}
_TOP_IGNORED = {
    "dtype",
    "torch_dtype",
    "transformers_version",
    "text_config",
    "vision_config",
    "quantization_config",
}
_QUANT_FIXED = {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
_QUANT_KEYS = {"weight_block_size", "expert_dtype", "fmt"}
_VISION_KEYS = {f.name for f in dataclasses.fields(VisionConfig)}
_ROPE_KEYS = {"rope_type", "type", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings"}


def _require_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_unknown(d: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; refusing to guess their meaning")


def _convert(field_name: str, value: Any, where: str) -> Any:
    ftype = {f.name: f.type for f in dataclasses.fields(ModelConfig)}[field_name]
    try:
        if "tuple" in str(ftype):
            if not isinstance(value, list | tuple):
                raise TypeError("expected a list")
            return tuple(int(v) for v in value)
        if ftype in ("int",) or ftype is int:
            if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
                raise TypeError("expected an integer")
            return int(value)
        if ftype in ("float",) or ftype is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError("expected a number")
            return float(value)
        if ftype in ("bool",) or ftype is bool:
            if not isinstance(value, bool):
                raise TypeError("expected true/false")
            return value
        if ftype in ("str",) or ftype is str:
            if not isinstance(value, str):
                raise TypeError("expected a string")
            return value
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}, got {value!r}") from None
    return value


def _from_hf(raw: dict[str, Any], *, name: str) -> ModelConfig:
    raw = _require_dict(raw, "config.json")
    _check_unknown(raw, _TOP_KEYS | set(_TOP_FIXED) | _TOP_IGNORED, "config.json")
    for key, expected in _TOP_FIXED.items():
        if key in raw and raw[key] != expected:
            raise ConfigError(f"config.json: {key} must be {expected!r}, got {raw[key]!r}")
    if "text_config" not in raw:
        raise ConfigError("config.json: missing 'text_config' (the nested V4.1 layout is required)")
    text = _require_dict(raw["text_config"], "text_config")
    _check_unknown(text, set(_TEXT_KEYS) | set(_TEXT_FIXED) | _TEXT_IGNORED | {"rope_scaling"}, "text_config")
    for key, expected in _TEXT_FIXED.items():
        if key in text and text[key] != expected:
            raise ConfigError(f"text_config.{key} must be {expected!r}, got {text[key]!r}")
    kw: dict[str, Any] = {"name": name}
    for key, fname in _TEXT_KEYS.items():
        if key in text:
            kw[fname] = _convert(fname, text[key], f"text_config.{key}")
    for key in _TOP_KEYS:
        if key in raw:
            kw[key] = _convert(key, raw[key], f"config.json.{key}")
    rope = _require_dict(text.get("rope_scaling"), "text_config.rope_scaling")
    _check_unknown(rope, _ROPE_KEYS, "text_config.rope_scaling")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type != "yarn":
        raise ConfigError(f"text_config.rope_scaling.rope_type must be 'yarn', got {rope_type!r}")
    for key, fname in (
        ("factor", "rope_factor"),
        ("beta_fast", "rope_beta_fast"),
        ("beta_slow", "rope_beta_slow"),
        ("original_max_position_embeddings", "rope_original_max_position"),
    ):
        if key not in rope:
            raise ConfigError(f"text_config.rope_scaling: missing '{key}'")
        kw[fname] = _convert(fname, rope[key], f"text_config.rope_scaling.{key}")
    quant = _require_dict(raw.get("quantization_config"), "quantization_config")
    _check_unknown(quant, set(_QUANT_FIXED) | _QUANT_KEYS, "quantization_config")
    for key, expected in _QUANT_FIXED.items():
        if quant.get(key) != expected:
            raise ConfigError(f"quantization_config.{key} must be {expected!r}, got {quant.get(key)!r}")
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list) and len(block) == 2 and block[0] == block[1] and isinstance(block[0], int)
    ):
        raise ConfigError(f"quantization_config.weight_block_size must be [B, B], got {block!r}")
    kw["weight_block_size"] = block[0]
    kw["expert_dtype"] = quant.get("expert_dtype", "fp4")
    if raw.get("vision_config") is not None:
        vis = _require_dict(raw["vision_config"], "vision_config")
        _check_unknown(vis, _VISION_KEYS | {"model_type"}, "vision_config")
        try:
            kw["vision"] = VisionConfig(**{k: v for k, v in vis.items() if k != "model_type"})
        except TypeError as e:
            raise ConfigError(f"vision_config: {e}") from None
    kw.setdefault("candidate_source_layer_id", -1)
    kw.setdefault("candidate_topk_blocks", 0)
    kw.setdefault("candidate_block_size", 1)
    missing = sorted(
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kw
    )
    if missing:
        inverse = {v: k for k, v in _TEXT_KEYS.items()}
        raise ConfigError(f"text_config: missing key(s) {[inverse.get(m, m) for m in missing]}")
    try:
        return ModelConfig(**kw)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    text: dict[str, Any] = {
        "model_type": "deepseek_v41_text",
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
    }
    for key, fname in _TEXT_KEYS.items():
        value = getattr(cfg, fname)
        text[key] = list(value) if isinstance(value, tuple) else value
    text["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": cfg.rope_factor,
        "beta_fast": cfg.rope_beta_fast,
        "beta_slow": cfg.rope_beta_slow,
        "original_max_position_embeddings": cfg.rope_original_max_position,
    }
    out: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "image_token_id": cfg.image_token_id,
        "text_config": text,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [cfg.weight_block_size, cfg.weight_block_size],
            "scale_fmt": "ue8m0",
            "expert_dtype": cfg.expert_dtype,
        },
    }
    if cfg.vision is not None:
        out["vision_config"] = {"model_type": "deepseek_v41_vision", **dataclasses.asdict(cfg.vision)}
    return out


# ---------------------------------------------------------------------- presets
def _v41_flash_hf() -> dict[str, Any]:
    """The released DeepSeek-V4.1-Flash config.json (spec section 1.2), as a dict."""
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 5120,
        "moe_intermediate_size": 2304,
        "num_hidden_layers": 40,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 16000000,
        "engram_compressed_vocab_size": 99092,
        "engram_pad_token_id": 2,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "text_config": text,
        "vision_config": {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": 32,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 2816,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        },
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
    }


ASSETS = Path(__file__).resolve().parent / "assets"


def _tiny_hf() -> dict[str, Any]:
    """The embedded tiny model: one of each layer kind (SWA-only, Full r=2, Reuse, Full r=1 candidate
    source, Reindex, Engram), the same schedule as the golden fixture tiny-a."""
    return json.loads((ASSETS / "tiny" / "config.json").read_text())


# tiny-draft: tiny's config; its weights differ (ced_jax.testing.random_weights.tiny_draft_preset_params)
PRESETS = {"v41-flash": _v41_flash_hf, "tiny": _tiny_hf, "tiny-draft": _tiny_hf}
# Old preset names, accepted for now with a DeprecationWarning naming the new one (the CLI prints it).
RENAMED_PRESETS = {"tiny-spec": "tiny-draft"}


def current_preset_name(name: str) -> str:
    """`name`, or the new name of a renamed preset (warning the caller that the old one will go)."""
    if name not in RENAMED_PRESETS:
        return name
    warnings.warn(
        f"preset {name!r} is now {RENAMED_PRESETS[name]!r}; the old name will be removed",
        DeprecationWarning,
        stacklevel=3,
    )
    return RENAMED_PRESETS[name]


def preset(name: str) -> ModelConfig:
    name = current_preset_name(name)
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return _from_hf(PRESETS[name](), name=name)
