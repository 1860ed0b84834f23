"""Images in serving: what a request carries for each image span, and the pipeline that makes it.

A request's images are expanded into its prompt ids before it reaches the scheduler: each image
placeholder becomes the image's token span (every position holds `image_token_id`; `token_types`
tells START / IMAGE / NEWLINE / END apart), and the span's embedding rows (delimiter vectors and
aligner rows, `ced_jax.vision.VisionEncoder.span_embeddings`) travel with the request, so the
scheduler and the engine never run the vision tower themselves.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class ImageInputError(ValueError):
    """A request's image is unusable: `field` names where it came from, `message` says why. The
    front ends answer it with HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True, eq=False)
class RequestImage:
    """One image span of a request's prompt.

    start         first prompt position of the span
    token_types   i32 [span_len]: 0 START, 1 IMAGE, 2 NEWLINE, 3 END (`ced_jax.vision` constants)
    span_embeds   f32 [span_len, D]: the embedding row of every span position (bf16-exact)
    content_hash  SHA-256 of the image's pixels after pre-processing: the span's prefix-cache key and
                  feature-cache key (the same pixels sent as a URL, base64 or a file id are one image)
    """

    start: int
    token_types: np.ndarray
    span_embeds: np.ndarray
    content_hash: bytes

    @property
    def span_len(self) -> int:
        return int(len(self.token_types))

    @property
    def end(self) -> int:
        return self.start + self.span_len
