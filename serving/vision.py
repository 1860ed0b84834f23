"""Images in serving: what a request carries for each image span, the pipeline that makes it, and
the ViT warm-up.

A request's images are expanded into its prompt ids before it reaches the scheduler: each image
placeholder becomes the image's token span (every position holds `image_token_id`; `token_types`
tells START / IMAGE / NEWLINE / END apart), and the span's embedding rows (delimiter vectors and
aligner rows, `ced_jax.vision.VisionEncoder.span_embeddings`) travel with the request, so the
scheduler and the engine never run the vision tower themselves.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from ced_jax.config import VisionConfig
from ced_jax.vision import IMAGE_PLACEHOLDER, ImageError, PreparedImage, build_vl_prompt, prepare_image


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


class ImagePipeline:
    """Images -> prompt spans for one model: pre-processing (always: its output is the cache key),
    then a feature cache of span rows keyed by the SHA-256 of the pre-processed pixels, bounded in
    bytes with LRU eviction, so the ViT runs once per distinct image however it was sent (URL,
    base64, file id, another lossless encoding of the same pixels).

    Thread-safe: gRPC worker threads and the HTTP front end's executor call it. Two requests that
    miss on the same image at the same moment may both run the ViT (the second result replaces the
    first, identical rows); the lock is never held while the ViT runs.

    encoder: `ced_jax.vision.VisionEncoder` (`span_embeddings(image) -> f32 [span_len, D]`).
    """

    def __init__(
        self,
        encoder,
        vcfg: VisionConfig,
        *,
        image_token_id: int,
        feature_cache_bytes: int,
        max_images_per_request: int,
        max_image_bytes: int,
        metrics=None,
    ):
        if feature_cache_bytes < 0 or max_images_per_request < 1 or max_image_bytes < 1:
            raise ValueError(
                "feature_cache_bytes must be >= 0, max_images_per_request and max_image_bytes >= 1"
            )
        self.encoder, self.vcfg, self.image_token_id = encoder, vcfg, image_token_id
        self.feature_cache_bytes = feature_cache_bytes
        self.max_images_per_request = max_images_per_request
        self.max_image_bytes = max_image_bytes
        self.metrics = metrics
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.cache_bytes = 0
        self.vit_runs = self.cache_hits = self.cache_misses = 0

    def prepare(self, data: bytes, *, field: str) -> tuple[PreparedImage, np.ndarray]:
        """(the pre-processed image, its span rows f32 [span_len, D]); ImageInputError(field) if the
        bytes are not a usable image."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ImageInputError(field, "expected the image's encoded bytes")
        if len(data) > self.max_image_bytes:
            raise ImageInputError(
                field,
                f"image of {len(data)} bytes exceeds the limit of {self.max_image_bytes} bytes "
                "(--max-image-bytes)",
            )
        try:
            image = prepare_image(bytes(data), self.vcfg, max_bytes=self.max_image_bytes)
        except ImageError as e:
            raise ImageInputError(field, str(e)) from None
        key = image.content_hash
        with self._lock:
            rows = self._cache.get(key)
            if rows is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
        if rows is not None:
            self._count("image_feature_cache_hits")
            return image, rows
        rows = np.asarray(self.encoder.span_embeddings(image), np.float32)
        rows.setflags(write=False)
        with self._lock:
            self.cache_misses += 1
            self.vit_runs += 1
            self._insert(key, rows)
        self._count("image_feature_cache_misses")
        self._count("vit_runs")
        return image, rows

    def _insert(self, key: bytes, rows: np.ndarray) -> None:
        if rows.nbytes > self.feature_cache_bytes:
            return  # larger than the whole cache: used once, not kept
        old = self._cache.pop(key, None)
        if old is not None:
            self.cache_bytes -= old.nbytes
        self._cache[key] = rows
        self.cache_bytes += rows.nbytes
        while self.cache_bytes > self.feature_cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self.cache_bytes -= evicted.nbytes
        if self.metrics is not None:
            self.metrics.image_feature_cache_bytes.set(self.cache_bytes)

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).inc()

    def build_prompt(
        self,
        prompt_text: str,
        images: Sequence[bytes],
        encode: Callable[[str], list[int]],
        *,
        field: str = "messages",
    ) -> tuple[tuple[int, ...], tuple[RequestImage, ...]]:
        """The prompt ids of `prompt_text` with each image placeholder expanded into its image's span
        (`encode` tokenises text without adding anything), and the spans for
        `GenerationRequest.images`. field: where the images came from, for errors (`field[i]`)."""
        if len(images) > self.max_images_per_request:
            raise ImageInputError(
                field,
                f"{len(images)} images in one request; the limit is {self.max_images_per_request} "
                "(--max-images-per-request)",
            )
        placeholders = prompt_text.count(IMAGE_PLACEHOLDER)
        if placeholders != len(images):
            raise ImageInputError(
                field, f"the prompt has {placeholders} image placeholders for {len(images)} images"
            )
        prepared = [self.prepare(data, field=f"{field}[{i}]") for i, data in enumerate(images)]
        if self.metrics is not None and images:
            self.metrics.images_per_request.observe(len(images))
        try:
            vl = build_vl_prompt(
                prompt_text, [p for p, _ in prepared], encode, image_token_id=self.image_token_id
            )
        except ImageError as e:
            raise ImageInputError(field, str(e)) from None
        spans = tuple(
            RequestImage(
                start=int(start),
                token_types=image.span_types.astype(np.int32),
                span_embeds=rows,
                content_hash=image.content_hash,
            )
            for start, (image, rows) in zip(vl.span_starts, prepared, strict=True)
        )
        return tuple(int(t) for t in vl.ids), spans


# Synthetic pictures (width, height) for the ViT warm-up: thin ones give the fewest patches after the
# pre-processing's upscaling to min_pixels (tiny-v: 645 patches for 28x2000 against 1521 for a square).
_WARMUP_SIZES = ((28, 2000), (2000, 28), (14, 4000), (4000, 14), (64, 64))


def warm_vision_encoder(encoder, vcfg) -> tuple[int, ...]:
    """Compiles the ViT + aligner program of every patch bucket a picture can need, so no request pays
    a compile; returns the buckets compiled. A bucket below the fewest patches any of `_WARMUP_SIZES`
    gives is skipped (no real picture is expected there: pre-processing scales every picture up to
    `min_pixels`); should one come, it compiles on first use (tiny-v: about 2 s on CPU).
    The runs count in `encoder.runs`, not in the pipeline's counters or metrics."""
    from PIL import Image

    smallest = min(
        (prepare_image(Image.new("RGB", size), vcfg) for size in _WARMUP_SIZES),
        key=lambda image: image.num_patches,
    )
    buckets = tuple(b for b in encoder.buckets if b >= smallest.num_patches)
    for bucket in buckets:
        encoder.features(smallest, bucket=bucket)
    return buckets
