"""Image requests through the serving engine: the scheduler, the page pool's prefix cache and
`JaxEngine` on the vision fixture's checkpoint (tests/golden/tiny-v: a real vision tower), with
image spans made by `serving.vision.ImagePipeline` (pre-processing, ViT + aligner, feature cache).

Exactness is checked against a cold run of the same request (prefix cache off): a prefix-cache hit
that ends inside or right after an image span replays cached tokens from inside the span or from its
end (their span rows come with the replayed chunk), over pages keyed by the image's content hash;
any slip changes the logits (the tiny random model turns one ulp into different tokens within a few
steps).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps
from serving_helpers import run_until_idle

import ced_jax
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.engine.protocol import SamplingParams
from serving.errors import InvalidRequest
from serving.requests import GenerationRequest
from serving.scheduling.scheduler import Scheduler
from serving.vision import ImageInputError, ImagePipeline, RequestImage

pytestmark = pytest.mark.timeout(900)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"
SLOTS, PAGE, CONTEXT, CHUNK = 4, 16, 512, 64
GREEDY = SamplingParams(temperature=0.0)
TEXT = "<｜User｜>Look at this picture<｜deepseek_image｜>and say what you see.<｜Assistant｜></think>"


def _config(**kw) -> ServeConfig:
    base = dict(
        max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,),
        max_tokens_limit=64, default_max_tokens=12, max_queued=16, metrics_port=None,
    )  # fmt: skip
    base.update(kw)
    return ServeConfig(**base)


@pytest.fixture(scope="module")
def model():
    return ced_jax.load(GOLDEN)


@pytest.fixture(scope="module")
def engine(model):
    eng = JaxEngine(model, _config())
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def pipeline(model):
    return _pipeline(model, feature_cache_bytes=1 << 24)


def _pipeline(model, **kw) -> ImagePipeline:
    args = dict(image_token_id=model.cfg.image_token_id, max_images_per_request=4, max_image_bytes=1 << 22)
    args.update(kw)
    return ImagePipeline(model.vision, model.cfg.vision, **args)


@pytest.fixture(scope="module")
def encode(model):
    tok = model.tokenizer
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


IMAGE1 = (GOLDEN / "image1.png").read_bytes()
MIRRORED = _png(ImageOps.mirror(Image.open(io.BytesIO(IMAGE1)).convert("RGB")))  # same grid, other pixels


def _request(rid: str, ids, images, **kw) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, prompt_token_ids=(0, *ids), images=tuple(
            RequestImage(im.start + 1, im.token_types, im.span_embeds, im.content_hash) for im in images
        ), sampling=GREEDY, max_tokens=12, logprobs=1, **kw,
    )  # fmt: skip


def _run(sched: Scheduler, reqs) -> dict:
    events = {r.request_id: [] for r in reqs}
    for r in reqs:
        sched.submit(r, events[r.request_id].append)
    run_until_idle(sched)
    out = {}
    for rid, evs in events.items():
        assert evs and evs[-1].final and evs[-1].error is None, (rid, evs[-1])
        tokens = [t for e in evs for t in e.token_ids]
        logprobs = [lp.logprob for e in evs for lp in e.logprobs]
        out[rid] = (tokens, logprobs, evs[-1].usage)
    return out


def test_pipeline_feature_cache(model, pipeline, encode):
    """The ViT runs once per distinct picture: the same bytes again, and the same pixels encoded as
    BMP, are hits (the key is the pixels after pre-processing); a mirrored picture is a miss."""
    runs, hits = pipeline.vit_runs, pipeline.cache_hits
    ids, (span,) = pipeline.build_prompt(TEXT, [IMAGE1], encode)
    assert pipeline.vit_runs == runs + 1
    bmp = _png(Image.open(io.BytesIO(IMAGE1)), "BMP")
    ids2, (span2,) = pipeline.build_prompt(TEXT, [bmp], encode)
    _, (span3,) = pipeline.build_prompt(TEXT, [IMAGE1], encode)
    assert pipeline.vit_runs == runs + 1 and pipeline.cache_hits == hits + 2
    assert ids2 == ids and span2.content_hash == span.content_hash
    assert np.array_equal(span3.span_embeds, span.span_embeds)
    _, (other,) = pipeline.build_prompt(TEXT, [MIRRORED], encode)
    assert pipeline.vit_runs == runs + 2 and other.content_hash != span.content_hash
    # The span: every position holds the image token id; the rows are the notebook API's.
    assert all(ids[i] == model.cfg.image_token_id for i in range(span.start, span.end))
    _, types, rows = model.encode_vl(TEXT, [IMAGE1], add_bos=False)
    assert np.array_equal(rows[span.start : span.end], span.span_embeds)
    assert np.array_equal(types[span.start : span.end], span.token_types)


def test_pipeline_bounds_and_errors(model, encode):
    small = _pipeline(model, feature_cache_bytes=1)  # nothing fits: every request runs the ViT
    small.build_prompt(TEXT, [IMAGE1], encode)
    small.build_prompt(TEXT, [IMAGE1], encode)
    assert small.vit_runs == 2 and small.cache_bytes == 0
    one = _pipeline(model, feature_cache_bytes=1 << 24)
    _, (span,) = one.build_prompt(TEXT, [IMAGE1], encode)
    one.feature_cache_bytes = span.span_embeds.nbytes  # room for one image's rows: LRU eviction
    one.build_prompt(TEXT, [MIRRORED], encode)
    one.build_prompt(TEXT, [IMAGE1], encode)
    assert one.vit_runs == 3 and one.cache_bytes == span.span_embeds.nbytes
    cases = [
        ([b"not an image"], "messages[0]"),
        ([IMAGE1[: len(IMAGE1) // 2]], "messages[0]"),  # truncated PNG
        ([IMAGE1] * 5, "messages"),  # more than max_images_per_request
        ([IMAGE1, IMAGE1], "messages"),  # two images, one placeholder
        ([b"x" * ((1 << 22) + 1)], "messages[0]"),  # over max_image_bytes
    ]
    for images, field in cases:
        with pytest.raises(ImageInputError) as e:
            one.build_prompt(TEXT, images, encode)
        assert e.value.field == field, e.value


def test_image_prefix_cache_hits_are_exact(model, engine, pipeline, encode):
    """A cold run, then the same request with the prefix cache on: the hit covers the image span (up
    to the last full page before the final prompt token) and every token and logprob is identical;
    the mirrored picture with the very same ids hits only the text before its span."""
    ids, spans = pipeline.build_prompt(TEXT, [IMAGE1], encode)
    _, mirrored = pipeline.build_prompt(TEXT, [MIRRORED], encode)
    tok = ModelTokenizer(model)
    cold = Scheduler(engine, tok, _config(enable_prefix_cache=False))
    want = _run(cold, [_request("cold", ids, spans)])["cold"]
    want_m = _run(cold, [_request("cold-m", ids, mirrored)])["cold-m"]
    assert want[0] != want_m[0] or want[1] != want_m[1], "the picture does not reach the output"
    assert cold.pool.num_referenced == 0

    sched = Scheduler(engine, tok, _config())
    first = _run(sched, [_request("a", ids, spans)])["a"]
    again = _run(sched, [_request("b", ids, spans)])["b"]
    other = _run(sched, [_request("c", ids, mirrored)])["c"]
    n = len(ids) + 1
    span_end = spans[0].end + 1
    assert first[:2] == want[:2] and first[2].cached_prompt_tokens == 0
    assert again[2].cached_prompt_tokens == (n - 1) // PAGE * PAGE >= span_end, again[2]
    assert again[:2] == want[:2], "a prefix-cache hit over an image span changed the output"
    assert other[2].cached_prompt_tokens == (spans[0].start + 1) // PAGE * PAGE
    assert other[:2] == want_m[:2]
    assert sched.pool.num_referenced == 0
    sched.pool.check_invariants()
    assert engine.compiles_after_warmup == 0  # image batches ran programs compiled at warm-up


def _aligned_prompts(pipeline, encode, at_end: bool):
    """Two prompts with the same picture and the same text for a few tokens after it, parting
    before the next page boundary. at_end: the text before the picture is padded so that the span
    ends exactly on a page boundary (BOS included); else the prompts part right after the span,
    which ends inside a page."""
    for pad in range(40):
        head = "<｜User｜>Look" + " at" * pad + " this picture"
        a = head + "<｜deepseek_image｜>and say what you see.<｜Assistant｜></think>"
        b = head + "<｜deepseek_image｜>and say nothing at all.<｜Assistant｜></think>"
        ids_a, spans_a = pipeline.build_prompt(a, [IMAGE1], encode)
        ids_b, spans_b = pipeline.build_prompt(b, [IMAGE1], encode)
        end = spans_a[0].end + 1  # after the BOS
        boundary = -(-end // PAGE) * PAGE
        part = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y) + 1
        if at_end and boundary == end and boundary + 2 <= part < boundary + PAGE:
            return (ids_a, spans_a), (ids_b, spans_b), boundary
        if not at_end and boundary != end and part < boundary:
            return (ids_a, spans_a), (ids_b, spans_b), boundary - PAGE
    raise AssertionError("no padding gives the wanted alignment")


@pytest.mark.parametrize("at_end", [True, False])
def test_resume_at_a_page_boundary_after_or_inside_a_span_is_exact(model, engine, pipeline, encode, at_end):
    """The second prompt hits the first's pages up to a page boundary: right at the span's end, or
    inside the span; the replay before the boundary starts inside the span (its chunk carries span
    rows and types). Its tokens and logprobs must equal its cold run."""
    (ids, spans), (ids2, spans2), boundary = _aligned_prompts(pipeline, encode, at_end)
    assert spans[0].start + 1 < boundary <= spans[0].end + 1
    replay_from = boundary - engine.spec.replay_tokens
    assert spans[0].start + 1 < replay_from, "the replay does not start inside the span"
    tok = ModelTokenizer(model)
    cold = _run(Scheduler(engine, tok, _config(enable_prefix_cache=False)), [_request("x", ids2, spans2)])["x"]
    sched = Scheduler(engine, tok, _config())
    _run(sched, [_request("first", ids, spans)])
    warm = _run(sched, [_request("y", ids2, spans2)])["y"]
    assert warm[2].cached_prompt_tokens == boundary
    assert warm[:2] == cold[:2]
    assert engine.compiles_after_warmup == 0


def test_bad_images_are_refused_and_leak_nothing(model, engine, pipeline, encode):
    ids, (span,) = pipeline.build_prompt(TEXT, [IMAGE1], encode)
    sched = Scheduler(engine, ModelTokenizer(model), _config())
    free = sched.pool.num_available
    bad = [
        ("images[0].start", dict(start=span.start)),  # shifted by the BOS: not on image ids
        ("images[0].span_embeds", dict(span_embeds=span.span_embeds[:, :7])),
        ("images[0].token_types", dict(token_types=np.full(span.span_len, 9, np.int32))),
        ("images[0].content_hash", dict(content_hash=b"short")),
    ]
    for field, change in bad:
        fields = dict(start=span.start + 1, token_types=span.token_types, span_embeds=span.span_embeds,
                      content_hash=span.content_hash)  # fmt: skip
        fields.update(change)
        req = GenerationRequest(request_id="bad", prompt_token_ids=(0, *ids), images=(RequestImage(**fields),))
        with pytest.raises(InvalidRequest) as e:
            sched.submit(req, lambda ev: None)
        assert e.value.field == field
    assert sched.pool.num_available == free and sched.num_in_flight == 0


def test_text_model_refuses_images(encode, pipeline):
    tiny = ced_jax.load("tiny")
    sched = Scheduler(JaxEngine(tiny, _config()), ModelTokenizer(tiny), _config())
    ids, spans = pipeline.build_prompt(TEXT, [IMAGE1], encode)
    ids = tuple(min(t, tiny.cfg.vocab_size - 1) for t in ids)  # tiny's vocabulary is smaller
    with pytest.raises(InvalidRequest, match="no vision tower") as e:
        sched.submit(GenerationRequest(request_id="r", prompt_token_ids=ids, images=spans), print)
    assert e.value.field == "images"


def _replay_at_span_end_prompts(pipeline, encode, replay: int):
    """Two prompts with the same picture, whose span ends on a page boundary e, and the same text
    after it until e + replay + a few tokens: the second one's hit is at e + replay, so its replay
    starts right at the span's end."""
    for pad in range(40):
        head = "<｜User｜>Look" + " at" * pad + " this picture"
        for words in range(4, 120, 4):
            body = head + "<｜deepseek_image｜>and" + " say" * words + " what you"
            a = body + " see.<｜Assistant｜></think>"
            b = body + " hear.<｜Assistant｜></think>"
            ids_a, spans_a = pipeline.build_prompt(a, [IMAGE1], encode)
            ids_b, spans_b = pipeline.build_prompt(b, [IMAGE1], encode)
            end = spans_a[0].end + 1  # after the BOS
            if end % PAGE:
                break  # another pad
            part = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y) + 1
            if end + replay <= part < end + replay + PAGE and len(ids_b) + 1 > end + replay:
                return (ids_a, spans_a), (ids_b, spans_b), end
            if part >= end + replay + PAGE:
                break
    raise AssertionError("no padding gives the wanted alignment")


def test_a_replay_that_starts_at_a_spans_end_marks_the_span_dead(model, engine, pipeline, encode):
    """The replay of the second prompt's hit starts right where the picture ends (its Engram history
    there is the span's last positions, sent as DEAD through `PrefillChunk.history_types`). Tokens
    and logprobs: the cold run's. (This cannot catch a wrong history: the replay's first positions
    lie outside the receptive field of the hit's boundary, by the choice of `replay_tokens`; measured,
    the output is the same with the span's ids in the history instead of DEAD.)"""
    replay = engine.spec.replay_tokens
    (ids, spans), (ids2, spans2), end = _replay_at_span_end_prompts(pipeline, encode, replay)
    tok = ModelTokenizer(model)
    cold = Scheduler(engine, tok, _config(enable_prefix_cache=False))
    cold = _run(cold, [_request("x", ids2, spans2)])["x"]
    sched = Scheduler(engine, tok, _config())
    _run(sched, [_request("first", ids, spans)])
    warm = _run(sched, [_request("y", ids2, spans2)])["y"]
    assert warm[2].cached_prompt_tokens == end + replay
    assert warm[:2] == cold[:2]
    assert engine.compiles_after_warmup == 0
