"""The vision tower's parameters (spec 5.2): DeepSeek-ViT blocks, the aligner and the image
delimiters, under their released names, all stored BF16. The checkpoint's inventory
(`ced_jax.checkpoint.mapping`) lists these, in this order."""

from __future__ import annotations

from ced_jax.config import ModelConfig


def vision_param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{released name: (shape, stored dtype)} of the vision group, empty without a tower."""
    v = cfg.vision
    if v is None:
        return {}
    h, d = v.hidden_size, cfg.hidden_size
    specs: dict[str, tuple[tuple[int, ...], str]] = {}

    def linear(name: str, out: int, inn: int, bias: bool) -> None:
        specs[f"{name}.weight"] = ((out, inn), "BF16")
        if bias:
            specs[f"{name}.bias"] = ((out,), "BF16")

    linear("vision.patch_embed.proj", h, 3 * v.patch_size * v.patch_size, True)
    for b in range(v.num_hidden_layers):
        p = f"vision.blocks.{b}."
        specs[f"{p}norm1.weight"] = ((h,), "BF16")
        specs[f"{p}norm2.weight"] = ((h,), "BF16")
        linear(f"{p}attn.wqkv", 3 * h, h, True)
        linear(f"{p}attn.wo", h, h, True)
        linear(f"{p}mlp.w1", 2 * v.intermediate_size, h, False)  # gate and up, fused
        linear(f"{p}mlp.w2", h, v.intermediate_size, False)
    specs["vision.norm.weight"] = ((h,), "BF16")
    linear("aligner.w1", d, h * v.downsample_ratio**2, True)
    linear("aligner.w2", d, d, True)
    for name in ("image_start", "image_end", "image_newline"):
        specs[name] = ((d,), "BF16")
    return specs
