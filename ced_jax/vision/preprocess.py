"""Image pre-processing and the image token span, as DeepSeek's V4.1 `image_processor.py` does it.

An image becomes a canvas of `n_vit_h x n_vit_w` patches of 14x14 pixels (the ViT's input) and a
`n_llm_h x n_llm_w` token grid after the aligner's 3x3 merge (spec 6.3). The text model sees

    [START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]

with every position carrying `image_token_id`; `token_types` tells them apart.

The plan (which canvas size) is a pure function of the original size and the vision config:
- upscale (keeping the aspect ratio, sizes truncated to integers) when the area is below
  `min_pixels`, then round each side up to a multiple of the patch size;
- if the span would then be longer than `max_image_tokens` (the span length, delimiters included:
  the fixture's 2282x140 plan "needs 226 > 200"), take the largest aspect-preserving size whose
  span fits (`_fit_token_budget`);
- the image is fitted into that canvas with `PIL.ImageOps.pad` (bicubic, grey 127 borders), or
  stretched with `Image.resize` when `max_wh_ratio` is set and the image is at least that wide.
Values are ((x / 255) - 0.5) / 0.5 in f32, rounded to bf16; we keep the uint8 canvas codes
(`patch_pixels`) and map them through the 256-entry table (`patch_value_table`).
"""

from __future__ import annotations

import hashlib
import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ced_jax.config import VisionConfig

TEXT, START, IMAGE, NEWLINE, END = -1, 0, 1, 2, 3
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
PAD_GREY = (127, 127, 127)

# Refuse before decoding: an encoded file this large, or a header claiming this many pixels, is not
# a picture anyone sends to a chat model (Pillow's own bomb limit is ~89M pixels, a warning only).
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


class ImageError(ValueError):
    """An image that cannot be used; the message names the problem (serving maps it to a 400)."""


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of an image's span: START, n_llm_h rows of (n_llm_w IMAGE + NEWLINE), END."""
    return n_llm_h * (n_llm_w + 1) + 2


def token_grid(height: int, width: int, vcfg: VisionConfig) -> tuple[int, int]:
    """(n_llm_h, n_llm_w) the aligner makes from a canvas of this pixel size."""
    p, r = vcfg.patch_size, vcfg.downsample_ratio
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fit_token_budget(height: int, width: int, vcfg: VisionConfig) -> tuple[int, int]:
    """The largest aspect-preserving canvas (multiples of the patch size) whose span fits the budget.

    With a token grid of h x w cells and h = w * (height / width), the span h * (w + 1) + 2 <= budget
    bounds w by the positive root of w^2 + w = (budget - 2) / ratio; each side then gets the whole
    number of aligner cells that fits and the common scale is the smaller one. Degenerate shapes
    (less than one cell on a side) collapse to one column or one row of cells."""
    budget, p = vcfg.max_image_tokens, vcfg.patch_size
    ratio = height / width
    max_w = math.sqrt((budget - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    cell = p * vcfg.downsample_ratio
    if max_w < 1.0:  # very tall
        return (budget - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide
        return cell, (budget - 3) * cell
    scale = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_canvas(width: int, height: int, vcfg: VisionConfig) -> tuple[int, int]:
    """(canvas height, canvas width) in pixels for an image of the given original size."""
    p = vcfg.patch_size
    w, h = width, height
    if vcfg.max_wh_ratio is not None and w > h * vcfg.max_wh_ratio:
        w = h * vcfg.max_wh_ratio
    if 0 < w * h < vcfg.min_pixels:
        up = (vcfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    canvas_w, canvas_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    if span_length(*token_grid(canvas_h, canvas_w, vcfg)) > vcfg.max_image_tokens:
        canvas_h, canvas_w = _fit_token_budget(h, w, vcfg)
        if span_length(*token_grid(canvas_h, canvas_w, vcfg)) > vcfg.max_image_tokens:
            raise ImageError(
                f"image of {width}x{height} pixels cannot fit max_image_tokens={vcfg.max_image_tokens}"
            )
    return canvas_h, canvas_w


def patch_value_table() -> np.ndarray:
    """f32 [256]: the bf16 ViT input value of each 8-bit pixel code, ((x / 255) - 0.5) / 0.5 in
    f32 (each step correctly rounded, as torch does) then rounded to bf16."""
    x = np.arange(256, dtype=np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


_VALUE_TABLE = patch_value_table()


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One pre-processed image: the 8-bit canvas as ViT patches, and its grids. Compared and hashed
    by identity (it holds an array); `content_hash` is the key for equal pixels.

    patch_pixels: uint8 [n_vit_h * n_vit_w, 3 * patch^2], patches row-major over the grid, values
    in (channel, kh, kw) order inside a patch."""

    patch_pixels: np.ndarray
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def span_len(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)

    @property
    def num_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def span_types(self) -> np.ndarray:
        """i32 [span_len]: START, then per token row IMAGE * n_llm_w + NEWLINE, then END."""
        row = [IMAGE] * self.n_llm_w + [NEWLINE]
        return np.asarray([START] + row * self.n_llm_h + [END], dtype=np.int32)

    @cached_property
    def content_hash(self) -> bytes:
        """SHA-256 of the pre-processed canvas and its grids: equal pixels give equal keys whatever
        the source encoding (PNG or JPEG bytes, a URL, a file id)."""
        h = hashlib.sha256()
        grid = np.asarray([self.n_vit_h, self.n_vit_w, self.n_llm_h, self.n_llm_w], dtype="<i8")
        h.update(grid.tobytes())
        h.update(np.ascontiguousarray(self.patch_pixels, dtype=np.uint8).tobytes())
        return h.digest()

    def patch_values(self) -> np.ndarray:
        """f32 [P, 3 * patch^2]: the ViT input, bf16-exact values."""
        return _VALUE_TABLE[self.patch_pixels]


def _decode_error(e: Exception, what: str) -> ImageError:
    text = str(e)
    if "truncat" in text.lower():
        return ImageError(f"truncated image: {text}")
    return ImageError(f"{what}: {text}")


def _open(data: bytes | Image.Image, max_bytes: int, max_pixels: int) -> Image.Image:
    if isinstance(data, Image.Image):
        image = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) == 0:
            raise ImageError("image: empty data")
        if len(data) > max_bytes:
            raise ImageError(f"image too large: {len(data)} bytes (limit {max_bytes})")
        try:
            image = Image.open(io.BytesIO(bytes(data)))
        except Image.DecompressionBombError:
            raise ImageError(
                f"image too large: more than {max_pixels} pixels (decompression bomb guard)"
            ) from None
        except UnidentifiedImageError:
            raise ImageError("not an image: the data is in no image format this server reads") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise _decode_error(e, "not a readable image") from None
    else:
        raise ImageError(f"image: expected bytes or a PIL image, got {type(data).__name__}")
    w, h = image.size
    if w <= 0 or h <= 0:
        raise ImageError(f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(f"image too large: {w}x{h} = {w * h} pixels (limit {max_pixels})")
    return image


def prepare_image(
    data: bytes | Image.Image,
    vcfg: VisionConfig,
    *,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> PreparedImage:
    """Decode (encoded bytes or a PIL image), plan, resize/pad and cut into patches.

    Raises ImageError: not an image, truncated or corrupt data, too many bytes or pixels, a mode
    that cannot become RGB."""
    image = _open(data, max_bytes, max_pixels)
    try:
        image.load()
        rgb = image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        if "mode" in str(e).lower() or "conversion" in str(e).lower():
            raise ImageError(f"unsupported image mode {image.mode!r}: {e}") from None
        raise _decode_error(e, "corrupt image") from None
    finally:
        if not isinstance(data, Image.Image):
            image.close()
    p = vcfg.patch_size
    canvas_h, canvas_w = plan_canvas(rgb.width, rgb.height, vcfg)
    if vcfg.max_wh_ratio is not None and rgb.width >= vcfg.max_wh_ratio * rgb.height:
        canvas = rgb.resize((canvas_w, canvas_h))
    else:
        canvas = ImageOps.pad(rgb, (canvas_w, canvas_h), color=PAD_GREY)
    pixels = np.asarray(canvas, dtype=np.uint8)  # [H, W, 3]
    n_h, n_w = canvas_h // p, canvas_w // p
    patches = pixels.reshape(n_h, p, n_w, p, 3).transpose(0, 2, 4, 1, 3).reshape(n_h * n_w, 3 * p * p)
    n_llm_h, n_llm_w = token_grid(canvas_h, canvas_w, vcfg)
    return PreparedImage(np.ascontiguousarray(patches), n_h, n_w, n_llm_h, n_llm_w)


@dataclass(frozen=True)
class VLPrompt:
    """A prompt with its image placeholders expanded into spans.

    ids: i32 [T] (every span position is `image_token_id`); token_types: i32 [T] (TEXT = -1
    outside spans); span_starts: the first position of each image's span, in image order."""

    ids: np.ndarray
    token_types: np.ndarray
    span_starts: tuple[int, ...]


def build_vl_prompt(
    prompt_text: str,
    images: Sequence[PreparedImage],
    encode: Callable[[str], list[int]],
    *,
    image_token_id: int,
    placeholder: str = IMAGE_PLACEHOLDER,
) -> VLPrompt:
    """Tokenise `prompt_text` and expand each placeholder into its image's span.

    As the reference's `prepare_vl_inputs`: the whole text is encoded at once (no special tokens
    added) and each occurrence of `image_token_id` in the result is one image, in order. `encode`
    must map `placeholder` to `image_token_id` (a tokenizer with the placeholder as a special token)."""
    text_count = len(re.findall(re.escape(placeholder), prompt_text)) if placeholder else None
    tokens = [int(t) for t in encode(prompt_text)]
    id_count = sum(t == image_token_id for t in tokens)
    if text_count is not None and text_count != id_count:
        raise ImageError(
            f"prompt: {text_count} image placeholders {placeholder!r} in the text but {id_count} "
            f"image tokens (id {image_token_id}) after tokenisation"
        )
    if id_count != len(images):
        raise ImageError(f"prompt has {id_count} image placeholders but {len(images)} images were given")
    ids: list[np.ndarray] = []
    types: list[np.ndarray] = []
    starts: list[int] = []
    pending: list[int] = []
    length = 0
    image_iter = iter(images)

    def flush() -> None:
        nonlocal length
        if pending:
            ids.append(np.asarray(pending, dtype=np.int32))
            types.append(np.full(len(pending), TEXT, dtype=np.int32))
            length += len(pending)
            pending.clear()

    for tok in tokens:
        if tok != image_token_id:
            pending.append(tok)
            continue
        flush()
        image = next(image_iter)
        starts.append(length)
        ids.append(np.full(image.span_len, image_token_id, dtype=np.int32))
        types.append(image.span_types)
        length += image.span_len
    flush()
    if not ids:
        return VLPrompt(np.zeros(0, np.int32), np.zeros(0, np.int32), ())
    return VLPrompt(np.concatenate(ids), np.concatenate(types), tuple(starts))
