"""serving.vision.ImagePipeline on its own, on tiny-v's vision tower: the feature cache (keyed by the
pixels after pre-processing, LRU in bytes), the refusals (each an ImageInputError naming its field), the
Prometheus counters, and concurrent callers."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps
from prometheus_client import generate_latest

import ced_jax
from serving.metrics import Metrics
from serving.vision import ImageInputError, ImagePipeline, warm_vision_encoder

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"
PLACEHOLDER = "<｜deepseek_image｜>"
IMAGE1 = (GOLDEN / "image1.png").read_bytes()
IMAGE2 = (GOLDEN / "image2.png").read_bytes()


def _encoded(data: bytes, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format=fmt)
    return buf.getvalue()


def _mirrored(data: bytes, flip=ImageOps.mirror) -> bytes:
    """The same picture mirrored (or flipped): same size, so the same span, other pixels."""
    buf = io.BytesIO()
    flip(Image.open(io.BytesIO(data)).convert("RGB")).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model():
    return ced_jax.load(GOLDEN)


@pytest.fixture(scope="module")
def encode(model):
    tok = model.tokenizer
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _pipeline(model, metrics=None, **kw) -> ImagePipeline:
    args = dict(
        image_token_id=model.cfg.image_token_id,
        feature_cache_bytes=1 << 26,
        max_images_per_request=3,
        max_image_bytes=1 << 22,
    )
    args.update(kw)
    return ImagePipeline(model.vision, model.cfg.vision, metrics=metrics, **args)


def _sample(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, f"{name} is not exported"
    return value


def test_same_image_twice_runs_the_vit_once(model):
    metrics = Metrics()
    pipe = _pipeline(model, metrics)
    runs_before = model.vision.runs
    image_a, rows_a = pipe.prepare(IMAGE1, field="images[0]")
    image_b, rows_b = pipe.prepare(IMAGE1, field="images[0]")
    assert (pipe.vit_runs, pipe.cache_hits, pipe.cache_misses) == (1, 1, 1)
    assert model.vision.runs - runs_before == 1  # the encoder's own count agrees
    assert image_a.content_hash == image_b.content_hash
    assert rows_a.shape == (image_a.span_len, model.cfg.hidden_size) and rows_a.dtype == np.float32
    np.testing.assert_array_equal(rows_a, rows_b)
    # The cached rows are the encoder's rows for that image.
    np.testing.assert_array_equal(rows_a, np.asarray(model.vision.span_embeddings(image_a), np.float32))
    assert pipe.cache_bytes == rows_a.nbytes
    assert _sample(metrics, "ced_vit_runs_total") == 1
    assert _sample(metrics, "ced_image_feature_cache_hits_total") == 1
    assert _sample(metrics, "ced_image_feature_cache_misses_total") == 1
    assert _sample(metrics, "ced_image_feature_cache_bytes") == rows_a.nbytes
    assert b"ced_vit_runs_total" in generate_latest(metrics.registry)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_same_pixels_in_another_lossless_format_is_a_hit(model, fmt):
    pipe = _pipeline(model)
    other = _encoded(IMAGE1, fmt)
    assert other != IMAGE1
    first, _ = pipe.prepare(IMAGE1, field="images[0]")
    again, _ = pipe.prepare(other, field="images[0]")
    assert again.content_hash == first.content_hash
    assert (pipe.vit_runs, pipe.cache_hits) == (1, 1)
    # Other pixels (the picture mirrored, same size) are a different image: a miss.
    mirrored, _ = pipe.prepare(_mirrored(IMAGE1), field="images[0]")
    assert mirrored.content_hash != first.content_hash
    assert (pipe.vit_runs, pipe.cache_misses) == (2, 2)


def test_lru_eviction_within_the_byte_budget(model):
    # Three pictures of one size (one span length): a budget of two entries keeps the two most
    # recently used.
    a, b, c = IMAGE1, _mirrored(IMAGE1), _mirrored(IMAGE1, ImageOps.flip)
    probe = _pipeline(model)
    sizes = {probe.prepare(x, field="f")[1].nbytes for x in (a, b, c)}
    assert len(sizes) == 1 and probe.vit_runs == 3
    entry = sizes.pop()
    pipe = _pipeline(model, feature_cache_bytes=2 * entry)

    def runs_after(data: bytes) -> int:
        pipe.prepare(data, field="f")
        return pipe.vit_runs

    assert [runs_after(x) for x in (a, b, a)] == [1, 2, 2]  # a is now the most recently used
    assert runs_after(c) == 3  # evicts b, the least recently used
    assert pipe.cache_bytes == 2 * entry
    assert runs_after(a) == 3  # still cached
    assert runs_after(b) == 4  # was evicted; now evicts c
    assert runs_after(c) == 5
    assert (pipe.cache_hits, pipe.cache_misses, pipe.cache_bytes) == (2, 5, 2 * entry)

    # A budget smaller than one entry: nothing is kept, every call runs the ViT.
    small = _pipeline(model, feature_cache_bytes=entry - 1)
    small.prepare(a, field="f")
    small.prepare(a, field="f")
    assert (small.vit_runs, small.cache_hits, small.cache_bytes) == (2, 0, 0)


def test_refusals_name_the_field(model, encode):
    pipe = _pipeline(model, max_image_bytes=len(IMAGE1))
    runs = model.vision.runs
    with pytest.raises(ImageInputError) as e:
        pipe.prepare(b"not an image at all", field="images[1]")
    assert e.value.field == "images[1]" and str(e.value).startswith("images[1]: ")
    with pytest.raises(ImageInputError) as e:
        pipe.prepare(IMAGE1[: len(IMAGE1) // 2], field="images[0]")  # truncated PNG
    assert e.value.field == "images[0]"
    with pytest.raises(ImageInputError) as e:
        pipe.prepare(IMAGE1 + b"\0", field="images[2]")
    assert e.value.field == "images[2]" and str(len(IMAGE1)) in e.value.message
    with pytest.raises(ImageInputError) as e:
        pipe.build_prompt(PLACEHOLDER * 4, [IMAGE1] * 4, encode, field="images")
    assert e.value.field == "images" and "4" in e.value.message and "3" in e.value.message
    with pytest.raises(ImageInputError) as e:
        pipe.build_prompt(f"one {PLACEHOLDER} only", [IMAGE1, IMAGE1], encode, field="messages")
    assert e.value.field == "messages" and "placeholder" in e.value.message
    with pytest.raises(ImageInputError) as e:
        pipe.build_prompt(f"{PLACEHOLDER} and {PLACEHOLDER}", [IMAGE1, b"\x89PNG junk"], encode)
    assert e.value.field == "messages[1]"
    assert model.vision.runs - runs <= 1  # only the good first image of the last call may have run


def test_build_prompt_matches_encode_vl(model, encode):
    """The prompt ids and spans are those of the notebook API's encode_vl (without its BOS)."""
    pipe = _pipeline(model)
    text = f"<｜User｜>Compare{PLACEHOLDER}with{PLACEHOLDER}<｜Assistant｜></think>"
    ids, spans = pipe.build_prompt(text, [IMAGE1, IMAGE2], encode)
    want_ids, want_types, want_rows = model.encode_vl(text, [IMAGE1, IMAGE2], add_bos=False)
    assert list(ids) == want_ids.tolist()
    types = np.full(len(ids), -1, np.int32)
    for span in spans:
        types[span.start : span.end] = span.token_types
        np.testing.assert_array_equal(span.span_embeds, want_rows[span.start : span.end])
        assert all(t == model.cfg.image_token_id for t in ids[span.start : span.end])
    np.testing.assert_array_equal(types, want_types)


def test_concurrent_callers(model):
    """Threads asking for the same two images at once: every caller gets the right rows, and the
    counters add up (a miss racing another miss on the same image may run the ViT twice)."""
    pipe = _pipeline(model)
    want = {}
    for data in (IMAGE1, IMAGE2):
        image, rows = _pipeline(model).prepare(data, field="f")
        want[image.content_hash] = rows
    errors, barrier = [], threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for k in range(4):
                image, rows = pipe.prepare((IMAGE1, IMAGE2)[(i + k) % 2], field="f")
                np.testing.assert_array_equal(rows, want[image.content_hash])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert pipe.cache_hits + pipe.cache_misses == 32
    assert pipe.vit_runs == pipe.cache_misses
    assert 2 <= pipe.vit_runs <= 16  # at most one run per image per racing first round
    assert pipe.cache_bytes == sum(r.nbytes for r in want.values())


def test_warm_up_compiles_the_buckets_pictures_use(model):
    """Every bucket a picture of the golden set or of a common shape lands in is compiled at warm-up."""
    from ced_jax.vision import prepare_image

    warmed = warm_vision_encoder(model.vision, model.cfg.vision)
    assert warmed and warmed[-1] == model.vision.buckets[-1]
    pictures = [
        IMAGE1,
        IMAGE2,
        *(_blank(size) for size in ((640, 480), (480, 640), (1920, 1080), (100, 1000))),
    ]
    for data in pictures:
        bucket = model.vision.bucket_for(prepare_image(data, model.cfg.vision).num_patches)
        assert bucket in warmed, (bucket, warmed)


def _blank(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()
