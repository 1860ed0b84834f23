"""Native vision (spec 6.3): image pre-processing, the ViT and the 3x3 aligner.

- `preprocess`: bytes or a PIL image -> `PreparedImage` (8-bit patches, grids, content hash);
  `build_vl_prompt` expands image placeholders into spans with `token_types`.
- `tower`: the ViT + aligner as pure functions and `VisionEncoder`, its jitted, patch-bucketed program.
- `params`: the tower's parameter specs (loading them: `ced_jax.checkpoint.vision`).
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

# The encoder imports JAX; load it on first use so that pre-processing (the HTTP front end's image
# checks) stays light.
_LAZY = {"VisionEncoder": "ced_jax.vision.tower"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ced_jax.vision' has no attribute {name!r}")


__all__ = [
    "VisionEncoder",
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
