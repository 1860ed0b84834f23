"""Native vision (spec 6.3): image pre-processing, the ViT and the 3x3 aligner, and their weights.

- `preprocess`: bytes or a PIL image -> `PreparedImage` (8-bit patches, grids, content hash);
  `build_vl_prompt` expands image placeholders into spans with `token_types`.
- `tower`: the ViT + aligner as pure functions and `VisionEncoder`, its jitted, patch-bucketed program.
- `weights`: `load_vision_params` from a released HF directory or a `convert_weights` output.
"""

from ced_jax.vision.preprocess import (
    END,
    IMAGE,
    IMAGE_PLACEHOLDER,
    NEWLINE,
    START,
    TEXT,
    ImageError,
    PreparedImage,
    VLPrompt,
    build_vl_prompt,
    prepare_image,
)

# The encoder and the weight loader import JAX / the checkpoint package; load them on first use so
# that pre-processing (the HTTP front end's image checks) stays light.
_LAZY = {
    "VisionEncoder": "ced_jax.vision.tower",
    "load_vision_params": "ced_jax.vision.weights",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ced_jax.vision' has no attribute {name!r}")


__all__ = [
    "VisionEncoder",
    "load_vision_params",
    "END",
    "IMAGE",
    "IMAGE_PLACEHOLDER",
    "NEWLINE",
    "START",
    "TEXT",
    "ImageError",
    "PreparedImage",
    "VLPrompt",
    "build_vl_prompt",
    "prepare_image",
]
