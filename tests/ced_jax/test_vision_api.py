"""The notebook API's image paths (`ced_jax.api.Model`): `encode_vl`, `logits(images=...)` and
`generate(..., images=...)` agree with the explicit `token_types` / `span_embeds` path.

The model is the vision golden fixture's (`--vision-golden DIR`); the image is made here. The
prompt is padded to a power of two so that `generate`'s padded prefill chunk and `logits` run the
same program shape (one compile, and bit-identical logits).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ced_jax.api import load
from ced_jax.vision import IMAGE_PLACEHOLDER, START


@pytest.fixture(scope="module")
def model(request):
    m = load(str(Path(request.config.getoption("vision_golden"))))
    if m.vision is None:
        pytest.skip("the fixture's model has no vision tower")
    return m


@pytest.fixture(scope="module")
def png() -> bytes:
    y, x = np.mgrid[0:60, 0:90]
    pixels = np.stack([x * 2, y * 4, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_encode_vl_expands_each_placeholder_into_its_span(model, png):
    ids, types, spans = model.encode_vl(f"a picture: {IMAGE_PLACEHOLDER} and text", [png, png][:1])
    (prepared,) = model.prepare_images([png])
    assert ids[0] == model.cfg.bos_token_id and types[0] == -1
    start = int(np.flatnonzero(types == START)[0])
    span = slice(start, start + prepared.span_len)
    np.testing.assert_array_equal(types[span], prepared.span_types)
    assert np.all(ids[span] == model.cfg.image_token_id)
    assert np.all(types[:start] == -1) and np.all(types[span.stop :] == -1)
    np.testing.assert_array_equal(spans[span], model.vision.span_embeddings(prepared))
    assert not spans[types < 0].any()
    with pytest.raises(ValueError, match="placeholder"):
        model.encode_vl(f"two {IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER}", [png])
    with pytest.raises(ValueError, match=r"images\[0\]"):
        model.encode_vl(f"x {IMAGE_PLACEHOLDER}", [b"not an image"])


def test_logits_and_generate_take_images(model, png):
    """`logits(images=...)` is `logits(span_embeds=...)` bit for bit, and greedy `generate(...,
    images=...)` picks the argmax of those logits. generate pads its prefill chunk to a power of two
    (`width`, the padding not written) and sizes its session likewise, so the prompt is width - 1
    ids and `logits` runs the same program on it plus one padding id (causal: the padding changes no
    earlier row)."""
    (prepared,) = model.prepare_images([png])
    width = 1 << (prepared.span_len + 8).bit_length()
    ids = np.random.default_rng(3).integers(20, model.cfg.vocab_size, width).astype(np.int32)
    ids[ids == model.cfg.image_token_id] = 20
    ids[0], ids[-1] = model.cfg.bos_token_id, model.cfg.pad_token_id
    types = np.full(width, -1, np.int32)
    span = slice(3, 3 + prepared.span_len)
    ids[span] = model.cfg.image_token_id
    types[span] = prepared.span_types
    spans = model.span_embeds_for(types, [prepared])
    by_image = model.logits(ids, token_types=types, images=[png])["prefill_logits_full"]
    by_rows = model.logits(ids, token_types=types, span_embeds=spans)["prefill_logits_full"]
    np.testing.assert_array_equal(by_image, by_rows)
    prompt = width - 1
    generated = model.generate(ids[:prompt].tolist(), max_tokens=1, images=[png], token_types=types[:prompt])
    assert generated["token_ids"] == [int(by_rows[prompt - 1].argmax())]
    # The image reaches the logits: the same ids typed as text give others.
    text_only = model.logits(ids, token_types=np.full(width, -1, np.int32), span_embeds=spans)
    assert np.abs(text_only["prefill_logits_full"][prompt - 1] - by_rows[prompt - 1]).max() > 1e-2
    with pytest.raises(ValueError, match="span"):
        model.logits(ids, token_types=types, images=[png, png])
