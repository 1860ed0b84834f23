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

__all__ = [
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
