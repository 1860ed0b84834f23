"""Image pre-processing and prompt expansion against DeepSeek's reference (spec 6.3).

The fixture is the vision golden fixture (`--vision-golden DIR`, default tests/golden/tiny-v): its
image files, `inputs.json` (image plans, prompt text, ids, token types), `config.json`,
`tokenizer.json` and the recorded `image{i}_patch_pixels` / `_grid` / `_span_types`,
`patch_value_lut`, `prompt_ids`, `token_types`. Shapes come from the fixture, never from here.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from ced_jax.config import ModelConfig
from ced_jax.vision.preprocess import (
    END,
    IMAGE,
    NEWLINE,
    START,
    TEXT,
    ImageError,
    build_vl_prompt,
    patch_value_table,
    plan_canvas,
    prepare_image,
    span_length,
)


@pytest.fixture(scope="module")
def golden(request):
    d = Path(request.config.getoption("vision_golden"))
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.vision is not None, f"{d}: config.json has no vision_config"
    inputs = json.loads((d / "inputs.json").read_text())
    expected = load_file(str(d / "expected.safetensors"))
    return d, cfg, inputs, expected


@pytest.fixture(scope="module")
def prepared(golden):
    d, cfg, inputs, _ = golden
    return [prepare_image((d / plan["file"]).read_bytes(), cfg.vision) for plan in inputs["images"]]


def test_patch_pixels_grids_and_span_types_bit_exact(golden, prepared):
    d, cfg, inputs, expected = golden
    p = cfg.vision.patch_size
    assert len(prepared) == len(inputs["images"]) > 0
    for i, (plan, image) in enumerate(zip(inputs["images"], prepared, strict=True)):
        want = expected[f"image{i}_patch_pixels"]
        assert image.patch_pixels.dtype == np.uint8 and image.patch_pixels.shape == want.shape, plan["file"]
        assert np.array_equal(image.patch_pixels, want), f"{plan['file']}: patch pixels differ"
        grid = expected[f"image{i}_grid"]
        assert [plan["start"], image.n_vit_h, image.n_vit_w, image.n_llm_h, image.n_llm_w] == grid.tolist()
        assert [image.n_vit_h * p, image.n_vit_w * p] == plan["resized_hw"]
        assert image.span_len == plan["span_len"] == span_length(image.n_llm_h, image.n_llm_w)
        if f"image{i}_span_types" in expected:
            assert np.array_equal(image.span_types, expected[f"image{i}_span_types"])
        w, h = plan["original_wh"]
        assert plan_canvas(w, h, cfg.vision) == tuple(plan["resized_hw"])


def test_patch_values_equal_the_reference_lut(golden, prepared):
    _, _, _, expected = golden
    assert "patch_value_lut" in expected, "required array patch_value_lut missing"
    lut = expected["patch_value_lut"]
    assert np.array_equal(patch_value_table(), lut)
    for i, image in enumerate(prepared):
        values = image.patch_values()
        assert values.dtype == np.float32
        assert np.array_equal(values, lut[expected[f"image{i}_patch_pixels"]])


def test_span_types_layout():
    from ced_jax.vision.preprocess import PreparedImage

    image = PreparedImage(np.zeros((2 * 7 * 9, 588), np.uint8), 6, 7, 2, 3)
    want = [START] + ([IMAGE] * 3 + [NEWLINE]) * 2 + [END]
    assert image.span_types.tolist() == want and image.span_len == len(want)


def _tokenizer_encode(d: Path):
    import tokenizers  # a dependency of the project: its absence is an error, not a skip

    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def test_build_vl_prompt_matches_reference_ids_and_types(golden, prepared):
    d, cfg, inputs, expected = golden
    encode = _tokenizer_encode(d)
    vl = build_vl_prompt(inputs["prompt_text"], prepared, encode, image_token_id=cfg.image_token_id)
    assert np.array_equal(vl.ids, expected["prompt_ids"])
    assert np.array_equal(vl.token_types, expected["token_types"])
    assert list(vl.ids) == inputs["prompt_ids"] and list(vl.token_types) == inputs["token_types"]
    assert vl.span_starts == tuple(plan["start"] for plan in inputs["images"])
    assert vl.ids.dtype == np.int32 and vl.token_types.dtype == np.int32
    assert (vl.token_types[vl.ids != cfg.image_token_id] == TEXT).all()


def test_build_vl_prompt_counts_must_match(golden, prepared):
    d, cfg, inputs, _ = golden
    encode = _tokenizer_encode(d)
    with pytest.raises(
        ImageError, match=rf"{len(prepared)} image placeholders but {len(prepared) + 1} images"
    ):
        build_vl_prompt(
            inputs["prompt_text"], [*prepared, prepared[0]], encode, image_token_id=cfg.image_token_id
        )
    with pytest.raises(ImageError, match=r"0 image placeholders but 1 images"):
        build_vl_prompt("no images here", prepared[:1], encode, image_token_id=cfg.image_token_id)


def test_content_hash_depends_on_pixels_not_encoding(golden):
    d, cfg, inputs, _ = golden
    source = Image.open(d / inputs["images"][0]["file"]).convert("RGB")
    encoded = {}
    for fmt in ("PNG", "BMP", "TIFF"):
        buf = io.BytesIO()
        source.save(buf, format=fmt)
        encoded[fmt] = buf.getvalue()
    assert len(set(encoded.values())) == 3
    hashes = {prepare_image(data, cfg.vision).content_hash for data in encoded.values()}
    hashes.add(prepare_image(source, cfg.vision).content_hash)
    assert len(hashes) == 1 and len(next(iter(hashes))) == 32
    changed = source.copy()
    changed.putpixel((0, 0), tuple(255 - c for c in changed.getpixel((0, 0))))
    assert prepare_image(changed, cfg.vision).content_hash not in hashes


def test_modes_convert_to_rgb(golden):
    _, cfg, _, _ = golden
    rgb = Image.new("RGB", (40, 30), (200, 10, 90))
    for mode in ("L", "P", "RGBA", "CMYK", "LA", "I", "1", "I;16", "F", "YCbCr", "PA"):
        image = prepare_image(rgb.convert(mode), cfg.vision)
        assert image.patch_pixels.shape == (image.n_vit_h * image.n_vit_w, 3 * cfg.vision.patch_size**2)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (no pixel data): enough for Pillow's size check."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_bad_images_raise_image_error(golden):
    d, cfg, inputs, _ = golden
    v = cfg.vision
    data = (d / inputs["images"][0]["file"]).read_bytes()
    cases = {
        "not an image": b"this is not an image at all" * 10,
        "empty": b"",
        "truncated": data[: len(data) // 2],
    }
    for what, payload in cases.items():
        with pytest.raises(ImageError) as e:
            prepare_image(payload, v)
        assert type(e.value) is ImageError, what
    with pytest.raises(ImageError, match="truncated"):
        prepare_image(data[: len(data) // 2], v)
    with pytest.raises(ImageError, match="not an image"):
        prepare_image(b"GIF89a-but-not-really" * 4, v)
    jpeg = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(jpeg, format="JPEG")
    with pytest.raises(ImageError, match="truncated"):
        prepare_image(jpeg.getvalue()[: len(jpeg.getvalue()) // 2], v)
    with pytest.raises(ImageError, match="unsupported image mode 'La'"):
        prepare_image(Image.new("La", (30, 20)), v)
    # Too many bytes, too many pixels (our limit, and Pillow's decompression-bomb guard far beyond it).
    with pytest.raises(ImageError, match=r"too large: \d+ bytes"):
        prepare_image(data, v, max_bytes=len(data) - 1)
    big = io.BytesIO()
    Image.new("RGB", (1200, 1000)).save(big, format="PNG")
    with pytest.raises(ImageError, match="too large: 1200x1000"):
        prepare_image(big.getvalue(), v, max_pixels=1_000_000)
    for w, h in ((20_000, 20_000), (8_000, 8_000)):
        with pytest.raises(ImageError, match="too large") as e:
            prepare_image(_png_header_only(w, h), v)
        assert type(e.value) is ImageError
    with pytest.raises(ImageError, match="expected bytes"):
        prepare_image("image.png", v)  # type: ignore[arg-type]


def test_plans_stay_within_the_token_budget(golden):
    """Extreme aspect ratios and sizes: every plan is whole patches and its span fits the budget."""
    _, cfg, _, _ = golden
    v = cfg.vision
    for w, h in ((1, 1), (1, 5000), (5000, 1), (40, 700), (700, 40), (3000, 2000), (544, 544), (9999, 17)):
        ch, cw = plan_canvas(w, h, v)
        assert ch % v.patch_size == 0 and cw % v.patch_size == 0 and ch > 0 and cw > 0
        n_llm = (
            -(-(ch // v.patch_size) // v.downsample_ratio),
            -(-(cw // v.patch_size) // v.downsample_ratio),
        )
        assert span_length(*n_llm) <= v.max_image_tokens, (w, h)
