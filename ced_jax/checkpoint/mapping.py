"""The one declarative table of the released DeepSeek-V4.1 HF checkpoint, derived from a ModelConfig.

`hf_inventory(cfg)` lists every tensor the release stores for `cfg` (spec sections 5.1 / 5.2): its
name, stored shape, safetensors dtype, the group it belongs to, and, for the random-weight generator
(`ced_jax.testing.random_weights`), how its values are drawn (`Init`) and how they are quantised
(`TensorSpec.quant`). It describes the model's checkpoint layout, so it lives with the model: the
loader, `describe`, the converter and the serving capacity planner all read it.

Conventions
- Names are the released ones: no `model.` prefix; quantised weights are `<w>.weight` + `<w>.scale`.
- dtypes are safetensors codes: F8_E4M3, F8_E8M0 (ue8m0 scale bytes), I8 (two FP4 e2m1 codes per
  byte, the even index in the low nibble), BF16, F32.
- Groups: "backbone" (layers, embed, head, norm and the Engram projections), "engram_table" (the
  two Engram hash tables and their row scales), "dspark" (`mtp.*`) and "vision" (`vision.*`,
  `aligner.*`, `image_*`).
- Parameter counting (the convention that reproduces the published 763,205,315,794): a parameter
  is one logical weight element. A packed FP4 I8 tensor [out, in/2] counts out*in, and `.scale`
  tensors count nothing. Section 4.3 / 5.4 of the spec; `test_mapping.py` checks every group.
- Init specs follow bench/configs/mid/README.md ("How to regenerate the weights"), generalised from
  the mid shapes (a linear's std is its published factor over sqrt(fan_in)). `mtp.*` and vision
  tensors have no published scheme; theirs is our own choice, documented at `_dspark` / `_vision`.

Our parameter tree mirrors these names, with three differences (`our_target`):
- routed experts are stacked: `layers.{i}.ffn.experts.{e}.{w}.{weight,scale}` ->
  `layers.{i}.ffn.experts.{w}.{weight,scale}` with a leading expert axis [E, ...];
- `layers.{i}.attn.wo_a.weight` is dequantised to bfloat16 with its `.scale` (as DeepSeek's
  convert.py does, because the model uses it through a grouped einsum, not an FP8 GEMM); the
  scale is consumed and has no path of its own;
- `mtp.*` (DSpark) stages map like backbone layers (experts stacked over their own
  `dspark_n_routed_experts`, `mtp.{k}.attn.wo_a` dequantised); the loader reads them only when asked
  (`include=("text", "dspark")`; `ced_jax.load(with_draft=...)` puts them under params["mtp"]). Vision
  tensors are not part of the text model's parameter tree, so the text loader skips them (the vision
  encoder reads its own group with `ced_jax.checkpoint.vision.load_vision_params`). `convert_weights` writes
  both into Orbax items of their own (`--include dspark`; vision by default when config.json has a
  vision tower), vision tensors under their released names.

Storage dtypes of our numpy arrays (`STORAGE_DTYPES`) keep the stored bytes unchanged: F8_E4M3 ->
float8_e4m3fn, F8_E8M0 -> uint8 (the raw exponent byte), I8 -> uint8 (raw packed bytes), BF16 ->
bfloat16, F32 -> float32.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np

from ced_jax.config import ModelConfig
from ced_jax.model.params import dspark_param_specs, flatten_specs, param_specs

Group = Literal["backbone", "engram_table", "dspark", "vision"]
GROUPS: tuple[Group, ...] = ("backbone", "engram_table", "dspark", "vision")
# The groups our model implements; "text" in loader `include=` stands for these.
TEXT_GROUPS: tuple[Group, ...] = ("backbone", "engram_table")
# The groups `our_param_specs` maps into the parameter tree: the text model's, and the DSpark stages
# (params["mtp"]), which are read only when asked for.
LOADABLE_GROUPS: tuple[Group, ...] = (*TEXT_GROUPS, "dspark")
# Optional groups: recognised by name even when the config does not describe them, then skipped
# (these notes say why in a load report).
SKIP_NOTES: dict[str, str] = {
    "dspark": "DSpark draft stages (mtp.*): read only when asked for (include 'dspark', "
    "ced_jax.load(with_draft=None|True)); skipped",
    "vision": "the vision tower / aligner / image delimiters are not text-model parameters; "
    "ced_jax.checkpoint.vision.load_vision_params reads them for the vision encoder; skipped here",
}

STORAGE_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8),
    "I8": np.dtype(np.uint8),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
}
# What safetensors.numpy.save_file needs to write each released dtype code (the bytes are ours, viewed
# as these dtypes): for writing checkpoints in the released layout (synthetic ones, trained stages).
FILE_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I8": np.dtype(np.int8),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
}
ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
FP4_GROUP = 32  # FP4 experts: one ue8m0 scale per 32 inputs, fixed by the format (not by B)


@dataclass(frozen=True)
class Init:
    """How the random-weight generator draws a tensor's float32 values (before any quantisation).

    normal: std * N(0, 1) + mean. uniform: [low, high). hc_base: a normal draw with `std`, then
    +1.0 at `diag` (the comb-matrix diagonal of the mHC mix vector).
    """

    kind: Literal["normal", "uniform", "hc_base"]
    std: float = 0.0
    mean: float = 0.0
    low: float = 0.0
    high: float = 0.0
    diag: tuple[int, ...] = ()


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor. `quant` is set on both halves of a quantised pair:
    "fp8" (B x B blocks), "fp4" (packed experts, 1 x 32 groups), "fp8_rows" (Engram tables, 1 x B).
    Scale tensors have `init=None`: they come from quantising their weight's draw."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: Group
    init: Init | None = None
    quant: Literal["fp8", "fp4", "fp8_rows"] | None = None

    @property
    def is_scale(self) -> bool:
        return self.quant is not None and self.dtype == "F8_E8M0"

    @property
    def weight_name(self) -> str:
        """The `.weight` a scale belongs to (the tensor itself otherwise)."""
        return self.name[: -len(".scale")] + ".weight" if self.is_scale else self.name

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """Shape of the values the tensor stands for: packed FP4 holds two per byte."""
        if self.dtype == "I8":
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape

    @property
    def params(self) -> int:
        return 0 if self.is_scale else math.prod(self.logical_shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


# ---------------------------------------------------------------------- table builders
class _Table:
    """Collects TensorSpecs in a fixed order; one helper per stored format."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.specs: dict[str, TensorSpec] = {}

    def _add(self, spec: TensorSpec) -> None:
        assert spec.name not in self.specs, spec.name
        self.specs[spec.name] = spec

    def fp8(self, w: str, out: int, inn: int, std: float, group: Group) -> None:
        b = self.block
        self._add(TensorSpec(f"{w}.weight", (out, inn), "F8_E4M3", group, Init("normal", std), "fp8"))
        self._add(TensorSpec(f"{w}.scale", (-(-out // b), -(-inn // b)), "F8_E8M0", group, None, "fp8"))

    def fp4(self, w: str, out: int, inn: int, std: float, group: Group) -> None:
        assert inn % FP4_GROUP == 0, (w, inn)
        self._add(TensorSpec(f"{w}.weight", (out, inn // 2), "I8", group, Init("normal", std), "fp4"))
        self._add(TensorSpec(f"{w}.scale", (out, inn // FP4_GROUP), "F8_E8M0", group, None, "fp4"))

    def fp8_rows(self, w: str, rows: int, cols: int, std: float, group: Group) -> None:
        b = self.block
        self._add(TensorSpec(f"{w}.weight", (rows, cols), "F8_E4M3", group, Init("normal", std), "fp8_rows"))
        self._add(TensorSpec(f"{w}.scale", (rows, -(-cols // b)), "F8_E8M0", group, None, "fp8_rows"))

    def bf16(self, name: str, shape: tuple[int, ...], std: float, group: Group, mean: float = 0.0) -> None:
        self._add(TensorSpec(name, shape, "BF16", group, Init("normal", std, mean)))

    def norm(self, name: str, dim: int, group: Group) -> None:
        # Every RMSNorm weight: mean 1.0, std 0.1 (mid README).
        self.bf16(name, (dim,), 0.1, group, mean=1.0)

    def f32(self, name: str, shape: tuple[int, ...], init: Init, group: Group) -> None:
        self._add(TensorSpec(name, shape, "F32", group, init))


def _inv_sqrt(n: int) -> float:
    return 1.0 / math.sqrt(n)


def _block(t: _Table, cfg: ModelConfig, p: str, n_experts: int, group: Group) -> None:
    """The tensors every block has (backbone layer or DSpark stage): attention projections, norms,
    mHC, router, routed and shared experts. `p` is the name prefix, e.g. "layers.3."."""
    D, H, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ql, G, ol, I = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, cfg.mix_hc
    t.fp8(f"{p}attn.wq_a", ql, D, _inv_sqrt(D), group)
    t.norm(f"{p}attn.q_norm.weight", ql, group)
    t.fp8(f"{p}attn.wq_b", H * hd, ql, _inv_sqrt(ql), group)
    t.fp8(f"{p}attn.wkv", hd, D, _inv_sqrt(D), group)
    t.norm(f"{p}attn.kv_norm.weight", hd, group)
    t.fp8(f"{p}attn.wo_a", G * ol, H * hd // G, _inv_sqrt(H * hd // G), group)
    t.fp8(f"{p}attn.wo_b", D, G * ol, _inv_sqrt(G * ol), group)
    t.f32(f"{p}attn.attn_sink", (H,), Init("normal", 0.5), group)
    t.norm(f"{p}attn_norm.weight", D, group)
    t.norm(f"{p}ffn_norm.weight", D, group)
    # Comb-diagonal positions of the mix vector [pre(hc), post(hc), comb(hc x hc)].
    diag = tuple(2 * hc + i * hc + i for i in range(hc))
    for site in ("attn", "ffn"):
        t.f32(f"{p}hc_{site}_fn", (mix, hc * D), Init("normal", _inv_sqrt(hc * D)), group)
        t.f32(f"{p}hc_{site}_base", (mix,), Init("hc_base", 0.5, diag=diag), group)
        t.f32(f"{p}hc_{site}_scale", (3,), Init("uniform", low=0.5, high=1.5), group)
    t.bf16(f"{p}ffn.gate.weight", (n_experts, D), 1.5 / math.sqrt(D), group)
    t.f32(f"{p}ffn.gate.bias", (n_experts,), Init("normal", 0.1), group)
    t.f32(f"{p}ffn.gate.bias_vl", (n_experts,), Init("normal", 0.1), group)
    up, down = 4.0 / math.sqrt(D), 0.25 / math.sqrt(I)
    for e in range(n_experts):
        t.fp4(f"{p}ffn.experts.{e}.w1", I, D, up, group)
        t.fp4(f"{p}ffn.experts.{e}.w2", D, I, down, group)
        t.fp4(f"{p}ffn.experts.{e}.w3", I, D, up, group)
    t.fp8(f"{p}ffn.shared_experts.w1", I, D, up, group)
    t.fp8(f"{p}ffn.shared_experts.w2", D, I, down, group)
    t.fp8(f"{p}ffn.shared_experts.w3", I, D, up, group)


def _backbone_layer(t: _Table, cfg: ModelConfig, i: int) -> None:
    D, hd, ql = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    p = f"layers.{i}."
    _block(t, cfg, p, cfg.n_routed_experts, "backbone")
    if i in cfg.kv_source_layer_ids:
        t.bf16(f"{p}attn.compressor.wkv.weight", (hd, D), _inv_sqrt(D), "backbone")
        if cfg.compress_ratio(i) > 1:  # ratio-1 compressors have no gate
            t.bf16(f"{p}attn.compressor.wgate.weight", (hd, D), _inv_sqrt(D), "backbone")
        t.norm(f"{p}attn.compressor.norm.weight", hd, "backbone")
    if i in cfg.index_source_layer_ids:
        iH, ihd = cfg.index_n_heads, cfg.index_head_dim
        t.fp8(f"{p}attn.indexer.wq_b", iH * ihd, ql, _inv_sqrt(ql), "backbone")
        t.bf16(f"{p}attn.indexer.weights_proj.weight", (iH, D), _inv_sqrt(D), "backbone")
        if i in cfg.kv_source_layer_ids:  # only owners of index keys project them
            t.bf16(f"{p}attn.indexer.wk.weight", (ihd, hd), _inv_sqrt(hd), "backbone")
            t.norm(f"{p}attn.indexer.k_norm.weight", ihd, "backbone")
    if i in cfg.engram_layer_ids:
        k = cfg.engram_layer_ids.index(i)
        ehd, hc = cfg.engram_head_dim, cfg.hc_mult
        t.fp8_rows(f"{p}engram.embed", cfg.engram_num_embeddings[k], ehd, 1.0, "engram_table")
        width = cfg.engram_hash_cols * ehd
        t.fp8(f"{p}engram.wkv", D * (hc + 1), width, _inv_sqrt(width), "backbone")
        t.bf16(f"{p}engram.q_weight", (hc, D), 0.1, "backbone", mean=1.0)
        t.bf16(f"{p}engram.k_weight", (hc, D), 0.1, "backbone", mean=1.0)


def _dspark(t: _Table, cfg: ModelConfig) -> None:
    """DSpark stages `mtp.{k}` (spec 5.2). Each is a SWA-only block over its own expert set; stage 0
    owns the projection of the target layers' hidden states, the last stage the final norm and the
    Markov / confidence heads. Init: the block follows the backbone scheme; the extra projections
    use 1/sqrt(fan_in), the Markov embedding std 1 and its head 2/sqrt(rank) like embed/head."""
    n = cfg.num_nextn_predict_layers
    D, V, r = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    for k in range(n):
        _block(t, cfg, f"mtp.{k}.", cfg.dspark_n_routed_experts, "dspark")
    n_targets = len(cfg.dspark_target_layer_ids)
    t.fp8("mtp.0.main_proj", D, n_targets * D, _inv_sqrt(n_targets * D), "dspark")
    t.norm("mtp.0.main_norm.weight", D, "dspark")
    last = f"mtp.{n - 1}."
    t.norm(f"{last}norm.weight", D, "dspark")
    t.bf16(f"{last}markov_head.embed.weight", (V, r), 1.0, "dspark")
    t.bf16(f"{last}markov_head.head.weight", (V, r), 2.0 / math.sqrt(r), "dspark")
    t.bf16(f"{last}confidence_head.proj.weight", (1, D + r), _inv_sqrt(D + r), "dspark")


def _vision(t: _Table, cfg: ModelConfig) -> None:
    """DeepSeek-ViT + aligner + image delimiters (`ced_jax.vision.params`), all BF16. Init (our
    choice): linears 1/sqrt(fan_in), biases std 0.02, norms as everywhere, delimiter embeddings std 1."""
    from ced_jax.vision.params import vision_param_specs

    for name, (shape, _) in vision_param_specs(cfg).items():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "vision.norm.weight":
            t.norm(name, shape[0], "vision")
        elif name.endswith(".bias"):
            t.bf16(name, shape, 0.02, "vision")
        elif name.endswith(".weight"):
            t.bf16(name, shape, _inv_sqrt(shape[1]), "vision")
        else:
            t.bf16(name, shape, 1.0, "vision")


def hf_inventory(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the released HF checkpoint for `cfg`, in a fixed order (embed, layers,
    norm, head, then mtp.*, then vision)."""
    t = _Table(cfg.weight_block_size)
    D, V = cfg.hidden_size, cfg.vocab_size
    t.bf16("embed.weight", (V, D), 1.0, "backbone")
    for i in range(cfg.num_layers):
        _backbone_layer(t, cfg, i)
    t.norm("norm.weight", D, "backbone")
    t.bf16("head.weight", (V, D), 2.0 / math.sqrt(D), "backbone")
    if cfg.num_nextn_predict_layers > 0:
        _dspark(t, cfg)
    if cfg.vision is not None:
        _vision(t, cfg)
    return t.specs


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """Logical parameters per group plus "total" (see the module docstring for the convention)."""
    counts = dict.fromkeys(GROUPS, 0)
    for spec in hf_inventory(cfg).values():
        counts[spec.group] += spec.params
    counts["total"] = sum(counts[g] for g in GROUPS)
    return counts


def optional_group_of(name: str) -> Group | None:
    """The optional group a tensor name belongs to by its prefix, whatever the config says."""
    if name.startswith("mtp."):
        return "dspark"
    if name.startswith(("vision.", "aligner.")) or name in ("image_start", "image_end", "image_newline"):
        return "vision"
    return None


# ---------------------------------------------------------------------- our parameter paths
# Backbone layers and DSpark stages (`mtp.{k}.`) share the block layout, so they map alike.
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123]\.(?:weight|scale))$")
_WO_A = re.compile(r"^((?:layers|mtp)\.\d+\.attn\.wo_a)\.(weight|scale)$")


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes in our tree. kind: "copy" (same name), "stack" (slot `expert` of a
    stacked array), "wo_a" (the FP8 weight, dequantised with its scale into `path`), "wo_a_scale"
    (consumed by that dequantisation; `path` is the weight's)."""

    path: str
    kind: Literal["copy", "stack", "wo_a", "wo_a_scale"]
    expert: int | None = None


DSPARK_PREFIX = "mtp."


def is_engram_table(path: str) -> bool:
    return ".engram.embed." in path


def our_target(hf_name: str) -> Target:
    """Map an HF name to our parameter path (pure name mapping): backbone, Engram tables and DSpark
    stages; anything else (vision) keeps its name."""
    m = _EXPERT.match(hf_name)
    if m:
        return Target(f"{m.group(1)}.{m.group(3)}", "stack", int(m.group(2)))
    m = _WO_A.match(hf_name)
    if m:
        path = f"{m.group(1)}.weight"
        return Target(path, "wo_a" if m.group(2) == "weight" else "wo_a_scale")
    return Target(hf_name, "copy")


def stacked_experts(cfg: ModelConfig, path: str) -> int:
    """The expert count a stacked expert path holds: a DSpark stage (`mtp.*`) has its own set."""
    return cfg.dspark_n_routed_experts if path.startswith("mtp.") else cfg.n_routed_experts


def our_param_specs(
    cfg: ModelConfig, groups: tuple[Group, ...] = TEXT_GROUPS
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Our parameter paths -> (shape, numpy storage dtype), for the implemented groups
    (`LOADABLE_GROUPS`: the text groups by default; "dspark" adds the `mtp.*` stages): the model's
    abstract tree (`ced_jax.model.params`), flattened."""
    unsupported = sorted(set(groups) - set(LOADABLE_GROUPS))
    if unsupported:
        raise ValueError(
            f"groups {unsupported} are not implemented here; {[SKIP_NOTES[g] for g in unsupported]}"
        )
    tree = flatten_specs({**param_specs(cfg), **dspark_param_specs(cfg)})
    return {
        path: (spec.shape, np.dtype(spec.dtype))
        for path, spec in tree.items()
        if _group_of_path(path) in groups
    }


def _group_of_path(path: str) -> Group:
    if path.startswith(DSPARK_PREFIX):
        return "dspark"
    return "engram_table" if is_engram_table(path) else "backbone"
