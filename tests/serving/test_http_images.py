"""Image input in the HTTP front end: every API's image parts -> the golden prompt, and every refusal.

The ground truth is the tiny-v fixture (`inputs.json`: DeepSeek's reference rendering of a system message
and a user turn with two images, and the token ids with each image expanded into its span). The same
conversation sent as OpenAI Chat (base64 data URLs, file ids), Responses (`input_image`) and Anthropic
Messages (base64, file sources) must give exactly the fixture's `prompt_ids` and span starts. The image
pipeline here is the server's `ImagePipeline` (serving/vision.py: the real pre-processing and span
expansion) over a stand-in ViT, so these tests need no engine. Error answers go through the real app
with the official SDKs (Starlette's TestClient is the SDKs' HTTP client), in each API's error shape.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import anthropic
import numpy as np
import openai
import pytest
import tokenizers
from serving_helpers import GoldenTokenizer, ServerThread, wait_until
from starlette.testclient import TestClient

from ced_jax.chat import PromptEncoder, render_messages
from ced_jax.config import ModelConfig
from serving.config import ServeConfig
from serving.files import FileStore
from serving.http.app import HttpFrontEnd
from serving.http.convert import CHAT, MESSAGES, RESPONSES, Converter
from serving.http.errors import ApiError
from serving.http.images import ImageResolver
from serving.image_fetch import ImageFetchConfig, ImageFetcher, ImageInputConfig
from serving.model_names import ModelCatalog
from serving.tenants import ApiKeys
from serving.testing.mock_engine import MockEngine
from serving.vision import ImagePipeline

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"
TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "ced_jax" / "assets" / "tiny" / "tokenizer.json"
INPUTS = json.loads((GOLDEN / "inputs.json").read_text())
IMAGES = [(GOLDEN / name).read_bytes() for name in INPUTS["image_files"]]
DATA_URLS = ["data:image/png;base64," + base64.b64encode(b).decode() for b in IMAGES]
SYSTEM = INPUTS["messages"][0]["content"]
TEXTS = [p["text"] for p in INPUTS["messages"][1]["content"] if p["type"] == "text"]
KEY = "sk-images-0123456789"
OTHER_KEY = "sk-images-other-tenant"
NO_THINKING = {"thinking": {"type": "disabled"}}  # the fixture renders in chat (non-thinking) mode


class ZeroRowsEncoder:
    """A stand-in ViT for `ImagePipeline`: zero rows of the span's length (these tests check prompts,
    spans and refusals; the served rows are checked in test_http_vision.py on the real tower)."""

    def span_embeddings(self, image):
        return np.zeros((image.span_len, 4), np.float32)


class FixturePipeline(ImagePipeline):
    """The serving ImagePipeline (real pre-processing and span expansion) over `ZeroRowsEncoder`,
    recording the bytes each call was given."""

    def __init__(self):
        cfg = ModelConfig.from_pretrained(GOLDEN)
        super().__init__(
            ZeroRowsEncoder(), cfg.vision, image_token_id=cfg.image_token_id, feature_cache_bytes=0,
            max_images_per_request=16, max_image_bytes=20 << 20,
        )  # fmt: skip
        self.calls: list[list[bytes]] = []

    def build_prompt(self, prompt_text, images, encode, *, field="messages"):
        self.calls.append(list(images))
        return super().build_prompt(prompt_text, images, encode, field=field)


def _converter(pipeline=None, *, fetch=None, limits=None, files=None) -> Converter:
    resolver = ImageResolver(files or FileStore(), ImageFetcher(fetch), limits)
    return Converter(
        tokenizers.Tokenizer.from_file(str(GOLDEN / "tokenizer.json")),
        catalog=ModelCatalog(ServeConfig().http_models),
        max_context=4096,
        max_tokens_limit=64,
        max_logprobs=5,
        images=pipeline,
        resolver=resolver,
    )


@pytest.fixture(scope="module")
def pipeline():
    return FixturePipeline()


@pytest.fixture()
def conv(pipeline):
    return _converter(pipeline)


def _chat(image_parts: list[dict], **extra) -> bytes:
    parts = [
        {"type": "text", "text": TEXTS[0]},
        image_parts[0],
        {"type": "text", "text": TEXTS[1]},
        image_parts[1],
        {"type": "text", "text": TEXTS[2]},
    ]
    body = {
        "model": "deepseek-flash",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}],
        **NO_THINKING,
        **extra,
    }
    return json.dumps(body).encode()


def _responses(image_parts: list[dict]) -> bytes:
    parts = [
        {"type": "input_text", "text": TEXTS[0]},
        image_parts[0],
        {"type": "input_text", "text": TEXTS[1]},
        image_parts[1],
        {"type": "input_text", "text": TEXTS[2]},
    ]
    body = {
        "model": "deepseek-flash",
        "instructions": SYSTEM,
        "input": [{"role": "user", "content": parts}],
        "reasoning": {"effort": "none"},
    }
    return json.dumps(body).encode()


def _messages(image_blocks: list[dict]) -> bytes:
    blocks = [
        {"type": "text", "text": TEXTS[0]},
        image_blocks[0],
        {"type": "text", "text": TEXTS[1]},
        image_blocks[1],
        {"type": "text", "text": TEXTS[2]},
    ]
    body = {
        "model": "deepseek-flash",
        "max_tokens": 8,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": blocks}],
        **NO_THINKING,
    }
    return json.dumps(body).encode()


def _b64_block(data: bytes, media_type: str = "image/png") -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()},
    }


def _expect_fixture(p) -> None:
    assert list(p.prompt_ids) == INPUTS["prompt_ids"]
    assert [(im.start, im.span_len) for im in p.images] == [
        (im["start"], im["span_len"]) for im in INPUTS["images"]
    ]


# ---- the chat layer ------------------------------------------------------------------------------------


def test_chat_layer_renders_the_fixture_prompt_and_lists_images_in_order():
    rendered = render_messages(
        INPUTS["messages"], thinking_mode=INPUTS["thinking_mode"], reasoning_effort=INPUTS["reasoning_effort"]
    )
    assert rendered.prompt == INPUTS["prompt_text"]
    assert [r["url"] for r in rendered.images] == INPUTS["image_files"]
    # Unexpanded ids: the fixture's ids with each span collapsed to one placeholder.
    expected, ids = (
        list(INPUTS["prompt_ids"]),
        PromptEncoder(tokenizers.Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))).encode(rendered),
    )
    for im in reversed(INPUTS["images"]):
        expected[im["start"] : im["start"] + im["span_len"]] = [expected[im["start"]]]
    assert ids == expected


# ---- every API and every way of sending an image gives the fixture's prompt ---------------------------


def test_openai_chat_base64_data_urls(conv):
    parts = [{"type": "image_url", "image_url": {"url": u, "detail": "high"}} for u in DATA_URLS]
    p = conv.prepare(CHAT, _chat(parts))
    _expect_fixture(p)
    assert len(p.prompt_ids) == len(INPUTS["prompt_ids"])  # usage counts each image as its span


def test_openai_chat_file_ids_hold_leases_until_released(pipeline):
    files = FileStore()
    conv = _converter(pipeline, files=files)
    ids = [files.upload("", b, filename=f"{i}.png", purpose="vision").id for i, b in enumerate(IMAGES)]
    p = conv.prepare(CHAT, _chat([{"type": "file", "file": {"file_id": i}} for i in ids]))
    _expect_fixture(p)
    assert len(p.leases) == 2
    for i in ids:  # deleted while the request runs: the request keeps its bytes
        files.delete("", i)
    assert files.stored_bytes == sum(len(b) for b in IMAGES)
    p.release()
    assert files.stored_bytes == 0 and files.record_count == 0


def test_openai_file_data_part(conv):
    parts = [{"type": "file", "file": {"file_data": u, "filename": "x.png"}} for u in DATA_URLS]
    _expect_fixture(conv.prepare(CHAT, _chat(parts)))


def test_responses_input_image_data_url_and_file_id(pipeline):
    files = FileStore()
    conv = _converter(pipeline, files=files)
    fid = files.upload("", IMAGES[1], filename="b.png", purpose="vision").id
    parts = [{"type": "input_image", "image_url": DATA_URLS[0]}, {"type": "input_image", "file_id": fid}]
    p = conv.prepare(RESPONSES, _responses(parts))
    _expect_fixture(p)
    p.release()


def test_anthropic_base64_and_file_sources(pipeline):
    files = FileStore()
    conv = _converter(pipeline, files=files)
    fid = files.upload("", IMAGES[1], filename="b.png", purpose="vision").id
    blocks = [_b64_block(IMAGES[0]), {"type": "image", "source": {"type": "file", "file_id": fid}}]
    p = conv.prepare(MESSAGES, _messages(blocks))
    _expect_fixture(p)
    p.release()
    assert files.stored_bytes == len(IMAGES[1])  # the file itself stays until deleted or expired


@pytest.fixture(scope="module")
def image_server():
    """The fixture directory over HTTP on 127.0.0.1 (a threaded http.server)."""
    handler = functools.partial(QuietHandler, directory=str(GOLDEN))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_image_urls_from_an_allowed_host(pipeline, image_server):
    fetch = ImageFetchConfig(allow_image_urls=True, allowed_hosts=("127.0.0.1",), timeout_s=5)
    conv = _converter(pipeline, fetch=fetch)
    urls = [f"{image_server}/{name}" for name in INPUTS["image_files"]]
    _expect_fixture(conv.prepare(CHAT, _chat([{"type": "image_url", "image_url": {"url": u}} for u in urls])))
    blocks = [{"type": "image", "source": {"type": "url", "url": u}} for u in urls]
    _expect_fixture(conv.prepare(MESSAGES, _messages(blocks)))
    # The same server by another name is not on the allow-list: refused, naming why.
    other = urls[0].replace("127.0.0.1", "localhost")
    with pytest.raises(
        ApiError, match=rf"{re.escape(FIELD)}: host 'localhost' is not in this server's allow-list"
    ):
        conv.prepare(CHAT, _one_image(other))
    with pytest.raises(ApiError, match=rf"{re.escape(FIELD)}: fetching the image URL answered HTTP 404"):
        conv.prepare(CHAT, _one_image(f"{image_server}/missing.png"))


def test_image_urls_are_fetched_on_the_fetch_pool_for_the_requests_tenant(image_server):
    """Issue 33.4: URL downloads run on the `image_fetch` pool, charged to the tenant of the `prepare`
    job that asked (so one tenant's trickling hosts hold at most half of the fetch threads)."""
    from serving.http.images import ImageRef
    from serving.work_pools import FairPool, current_tenant

    seen = []

    class Recording(ImageFetcher):
        def fetch(self, url):
            seen.append((current_tenant(), threading.current_thread().name))
            return super().fetch(url)

    fetch_pool, prepare = FairPool("image-fetch", 4), FairPool("prepare", 2)
    fetcher = Recording(ImageFetchConfig(allow_image_urls=True, allowed_hosts=("127.0.0.1",), timeout_s=5))
    resolver = ImageResolver(FileStore(), fetcher, fetch_pool=fetch_pool)
    url = f"{image_server}/{INPUTS['image_files'][0]}"
    ref = ImageRef(field="messages[0].content[0]", kind="url", value=url)
    data = prepare.submit("tenant-a", resolver.resolve, [ref], "", []).result(30)
    assert data[0] == (GOLDEN / INPUTS["image_files"][0]).read_bytes()
    assert len(seen) == 1 and seen[0][0] == "tenant-a" and seen[0][1].startswith("ced-image-fetch")
    fetch_pool.close()
    prepare.close()


def test_the_same_image_twice_is_passed_as_one_bytes_object(pipeline):
    conv = _converter(pipeline)
    parts = [{"type": "image_url", "image_url": {"url": DATA_URLS[0]}}] * 2
    conv.prepare(CHAT, _chat(parts))
    first, second = pipeline.calls[-1]
    assert first is second


def test_files_are_scoped_to_the_identity(pipeline):
    files = FileStore()
    conv = _converter(pipeline, files=files)
    fid = files.upload("alice", IMAGES[0], filename="a.png", purpose="vision").id
    parts = [
        {"type": "file", "file": {"file_id": fid}},
        {"type": "image_url", "image_url": {"url": DATA_URLS[1]}},
    ]
    conv.prepare(CHAT, _chat(parts), "alice").release()
    with pytest.raises(ApiError, match=r"messages\[1\].content\[1\].file.file_id: no such file") as e:
        conv.prepare(CHAT, _chat(parts), "bob")
    assert e.value.status == 400 and e.value.param == "messages[1].content[1].file.file_id"


# ---- refusals name the field and the problem ---------------------------------------------------------------


def _one_image(url: str) -> bytes:
    return _chat(
        [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "image_url", "image_url": {"url": DATA_URLS[1]}},
        ]
    )


FIELD = "messages[1].content[1].image_url.url"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("data:image/png;base64,@@not base64@@", "invalid base64"),
        ("data:image/png," + "x" * 8, "must be base64-encoded"),
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "is not an image"),
        (
            "data:image/jpeg;base64," + base64.b64encode(IMAGES[0]).decode(),
            "declared as image/jpeg but the data is image/png",
        ),
        ("ftp://example.org/a.png", "expected an http(s) URL or a data: URL"),
        ("https://example.org/a.png", "URL fetching is disabled on this server; send the image as base64"),
    ],
)
def test_bad_images_are_400_naming_the_field(conv, url, problem):
    with pytest.raises(ApiError) as e:
        conv.prepare(CHAT, _one_image(url))
    assert e.value.status == 400 and e.value.param == FIELD
    assert e.value.message.startswith(FIELD) and problem in e.value.message


def test_truncated_image_is_400_from_the_pipeline(conv):
    truncated = "data:image/png;base64," + base64.b64encode(IMAGES[0][: len(IMAGES[0]) // 2]).decode()
    with pytest.raises(ApiError, match=rf"^{re.escape(FIELD)}: truncated image") as e:
        conv.prepare(CHAT, _one_image(truncated))
    assert e.value.status == 400 and e.value.param == FIELD
    # The second image of a request is named as such (the pipeline's image index mapped back).
    second = "messages[1].content[3].image_url.url"
    with pytest.raises(ApiError, match=rf"^{re.escape(second)}: truncated image"):
        conv.prepare(
            CHAT, _chat([{"type": "image_url", "image_url": {"url": u}} for u in (DATA_URLS[0], truncated)])
        )


def test_size_and_count_limits(pipeline):
    small = _converter(pipeline, limits=ImageInputConfig(max_image_bytes=len(IMAGES[1])))
    with pytest.raises(
        ApiError, match=rf"{re.escape(FIELD)}: the image is about .* up to {len(IMAGES[1])} bytes"
    ):
        small.prepare(CHAT, _one_image(DATA_URLS[0]))
    one = _converter(pipeline, limits=ImageInputConfig(max_images_per_request=1))
    with pytest.raises(
        ApiError, match=r"messages\[1\].content\[3\].image_url.url: too many images .*at most 1"
    ):
        one.prepare(CHAT, _one_image(DATA_URLS[0]))


def test_unknown_file_id_and_bad_parts(conv):
    with pytest.raises(ApiError, match=r"messages\[1\].content\[1\].file.file_id: no such file: 'file-nope'"):
        conv.prepare(CHAT, _chat([{"type": "file", "file": {"file_id": "file-nope"}}] * 2))
    with pytest.raises(ApiError, match=r"messages\[1\].content\[1\].file: needs file_id or file_data"):
        conv.prepare(CHAT, _chat([{"type": "file", "file": {}}] * 2))
    with pytest.raises(ApiError, match=r"input\[0\].content\[1\]: needs image_url or file_id"):
        conv.prepare(RESPONSES, _responses([{"type": "input_image"}] * 2))


def test_anthropic_media_type_checks(conv):
    with pytest.raises(ApiError, match=r"messages\[0\].content\[1\].source.data: .*declared as image/webp"):
        conv.prepare(MESSAGES, _messages([_b64_block(IMAGES[0], "image/webp"), _b64_block(IMAGES[1])]))
    with pytest.raises(ApiError, match=r"messages\[0\].content\[1\].source.media_type: expected one of"):
        conv.prepare(MESSAGES, _messages([_b64_block(IMAGES[0], "image/bmp"), _b64_block(IMAGES[1])]))
    url_block = {"type": "image", "source": {"type": "url", "url": "https://example.org/a.png"}}
    with pytest.raises(
        ApiError, match=r"messages\[0\].content\[1\].source.url: image URL fetching is disabled"
    ):
        conv.prepare(MESSAGES, _messages([url_block, _b64_block(IMAGES[1])]))


def test_a_model_without_vision_refuses_images():
    conv = _converter(None)
    with pytest.raises(
        ApiError, match=r"messages\[1\].content\[1\].image_url.url: this model has no vision input"
    ):
        conv.prepare(CHAT, _one_image(DATA_URLS[0]))
    # Text-only requests are unaffected.
    text = json.dumps({"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert conv.prepare(CHAT, text).images == ()


def test_leases_are_released_when_a_later_image_is_refused(pipeline):
    files = FileStore()
    conv = _converter(pipeline, files=files)
    fid = files.upload("", IMAGES[0], filename="a.png", purpose="vision").id
    bad = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    parts = [{"type": "file", "file": {"file_id": fid}}, {"type": "image_url", "image_url": {"url": bad}}]
    with pytest.raises(ApiError, match="is not an image"):
        conv.prepare(CHAT, _chat(parts))
    files.delete("", fid)
    assert files.stored_bytes == 0  # no lease was left behind


# ---- through the app, in each API's error shape ----------------------------------------------------------


@pytest.fixture()
def app_client(pipeline):
    config = ServeConfig(api_keys=ApiKeys.parse([f"{KEY} tester"]), http_port=0, metrics_port=None)
    fe = HttpFrontEnd(config)
    scheduler = SimpleNamespace(spec=SimpleNamespace(max_context=4096))
    fe.attach(scheduler, SimpleNamespace(tokenizer_file=GOLDEN / "tokenizer.json"), images=pipeline)
    with TestClient(fe.app) as client:
        yield fe, client


def test_openai_sdk_gets_invalid_request_error_with_param(app_client):
    fe, client = app_client
    oai = openai.OpenAI(base_url="http://testserver", api_key=KEY, http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="deepseek-flash",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}],
                }
            ],
        )
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == "messages[0].content[0].image_url.url"
    assert "invalid base64" in err["message"]
    with pytest.raises(openai.BadRequestError, match="URL fetching is disabled") as e:
        oai.responses.create(
            model="deepseek-flash",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "https://example.org/a.png"}],
                }
            ],
        )
    assert e.value.body["param"] == "input[0].content[0].image_url"


def test_anthropic_sdk_gets_invalid_request_error(app_client):
    fe, client = app_client
    claude = anthropic.Anthropic(
        base_url="http://testserver/anthropic", api_key=KEY, http_client=client, max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="deepseek-flash",
            max_tokens=8,
            messages=[{"role": "user", "content": [_b64_block(IMAGES[0], "image/gif")]}],
        )
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].source.data" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="no such file"):
        claude.messages.create(
            model="deepseek-flash",
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "file", "file_id": "file-x"}}],
                }
            ],
        )


def test_uploaded_file_is_usable_and_released_after_a_failed_request(app_client):
    fe, client = app_client
    oai = openai.OpenAI(base_url="http://testserver", api_key=KEY, http_client=client, max_retries=0)
    f = oai.files.create(file=("a.png", IMAGES[0]), purpose="vision")
    body = json.loads(
        _chat(
            [
                {"type": "file", "file": {"file_id": f.id}},
                {"type": "image_url", "image_url": {"url": "data:,x"}},
            ]
        )
    )
    with pytest.raises(openai.BadRequestError, match="must be base64"):
        oai.chat.completions.create(
            model=body["model"], messages=body["messages"], extra_body={"thinking": body["thinking"]}
        )
    oai.files.delete(f.id)
    assert fe.files.stored_bytes == 0


# ---- over real HTTP: a served request's usage, and leases through a whole (streamed) request ------------


class SpansAsText(FixturePipeline):
    """The fixture pipeline without spans: the mock engine runs the expanded ids as text, so the HTTP
    path (usage, leases, streaming) is checked without a vision engine."""

    def build_prompt(self, prompt_text, images, encode, *, field="messages"):
        ids, _ = super().build_prompt(prompt_text, images, encode, field=field)
        return ids, ()


@pytest.fixture(scope="module")
def served():

    shapes = dict(max_slots=4, page_size=16, num_pages=128, max_context=1024, prefill_buckets=(64,))
    engine = MockEngine(**shapes, vocab_size=640, max_logprobs=5, step_delay_s=0.02)
    engine.warmup()
    config = ServeConfig(
        **shapes, max_logprobs=5, max_tokens_limit=64, default_max_tokens=8, max_queued=8, metrics_port=None,
        http_port=0, api_keys=ApiKeys.parse([f"{KEY} tester", f"{OTHER_KEY} other"]),
    )  # fmt: skip
    st = ServerThread(engine, GoldenTokenizer(), config)
    http = st.server.http
    http.attach(st.scheduler, GoldenTokenizer(), images=SpansAsText())
    st.http = http
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    yield st
    st.close()


def test_served_usage_counts_image_spans_and_files_are_freed(served):
    oai = openai.OpenAI(base_url=served.base, api_key=KEY, max_retries=0, timeout=60)
    ids = [oai.files.create(file=(f"{i}.png", b), purpose="vision").id for i, b in enumerate(IMAGES)]
    body = json.loads(_chat([{"type": "file", "file": {"file_id": i}} for i in ids]))
    r = oai.chat.completions.create(
        model="deepseek-flash", messages=body["messages"], max_tokens=4, extra_body=NO_THINKING
    )
    assert r.usage.prompt_tokens == len(INPUTS["prompt_ids"])  # each image counted as its span
    stream = oai.chat.completions.create(
        model="deepseek-flash",
        messages=body["messages"],
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**NO_THINKING, "ignore_eos": True},
    )
    usage = None
    for n, chunk in enumerate(stream):
        if n == 1:  # the request is running: delete its files, which it keeps using
            for i in ids:
                oai.files.delete(i)
            assert served.http.files.stored_bytes == sum(len(b) for b in IMAGES)
        usage = chunk.usage or usage
    assert usage.prompt_tokens == len(INPUTS["prompt_ids"])
    # The stream ended: its leases are given back (when the server's generator closes, just after the
    # last event), and nothing is left of the deleted files.
    files = served.http.files
    wait_until(lambda: files.stored_bytes == 0 and files.record_count == 0, timeout=5)
    registry = served.server.metrics.registry
    assert registry.get_sample_value("ced_files_stored_bytes") == 0
    assert registry.get_sample_value("ced_http_images_total", {"source": "file", "outcome": "accepted"}) == 4


def test_served_anthropic_base64_usage(served):
    claude = anthropic.Anthropic(base_url=f"{served.base}/anthropic", api_key=KEY, max_retries=0, timeout=60)
    body = json.loads(_messages([_b64_block(b) for b in IMAGES]))
    r = claude.messages.create(
        model="deepseek-flash", max_tokens=4, system=body["system"], messages=body["messages"],
        extra_body=NO_THINKING,
    )  # fmt: skip
    # Anthropic's input_tokens leave out prompt-cache reads (the previous test sent the same prompt).
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(INPUTS["prompt_ids"])


def test_one_tenants_slow_preparations_do_not_hold_up_another(served, monkeypatch):
    """Issue 33.4: request preparation ran on asyncio's default pool (6 threads here), so six slow
    requests of one tenant (10 MB messages, image URLs that trickle) held up every other tenant. Now
    a tenant runs at most half of the prepare pool: with six of tester's requests stuck in
    preparation, other's request is answered before any of them."""
    import urllib.request

    http = served.server.http
    real, release = http.converter.prepare, threading.Event()
    stuck = []

    def prepare(api, raw, identity):
        if b"stuck" in raw:
            stuck.append(identity)
            assert release.wait(60)
        return real(api, raw, identity)

    monkeypatch.setattr(http.converter, "prepare", prepare)

    def chat(key: str, text: str) -> int:
        body = {"model": "deepseek-flash", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        req = urllib.request.Request(
            served.base + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status

    results: list[int] = []
    slow = [threading.Thread(target=lambda: results.append(chat(KEY, "stuck"))) for _ in range(6)]
    for t in slow:
        t.start()
    pool = http.pools.prepare
    wait_until(lambda: pool.counts() == (pool.share, 6 - pool.share), timeout=30)
    assert stuck == ["tester"] * pool.share
    jobs = lambda state: served.server.metrics.registry.get_sample_value(  # noqa: E731
        "ced_pool_jobs", {"pool": "prepare", "state": state}
    )
    assert (jobs("running"), jobs("waiting")) == (pool.share, 6 - pool.share)  # what /metrics shows
    try:
        assert chat(OTHER_KEY, "quick") == 200
        assert results == []  # every one of tester's requests is still in preparation
    finally:
        release.set()
        for t in slow:
            t.join(60)
    assert results == [200] * 6


@pytest.fixture(scope="module")
def served_without_keys():
    shapes = dict(max_slots=4, page_size=16, num_pages=128, max_context=1024, prefill_buckets=(64,))
    engine = MockEngine(**shapes, vocab_size=640, max_logprobs=5)
    engine.warmup()
    config = ServeConfig(
        **shapes, max_logprobs=5, max_tokens_limit=64, default_max_tokens=8, max_queued=8, metrics_port=None,
        http_port=0,
    )  # fmt: skip
    st = ServerThread(engine, GoldenTokenizer(), config)
    st.server.http.attach(st.scheduler, GoldenTokenizer(), images=SpansAsText())
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    yield st
    st.close()


def test_an_over_long_user_is_refused_as_over_grpc(served_without_keys):
    """Issue 33.8: without API keys the body's user names the cache scope; a name was cut to its
    first 256 characters, so two users sharing them shared a scope. Now 400 naming the field."""
    base = served_without_keys.base
    oai = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    chat = dict(model="deepseek-flash", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body=NO_THINKING)  # fmt: skip
    assert oai.chat.completions.create(**chat, user="u" * 256).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**chat, user="u" * 257)
    assert "user: has 257 characters; the limit is max_user_length = 256" in str(e.value)
    claude = anthropic.Anthropic(base_url=f"{base}/anthropic", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="deepseek-flash", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            metadata={"user_id": "v" * 300}, extra_body=NO_THINKING,
        )  # fmt: skip
    assert "metadata.user_id: has 300 characters" in str(e.value)


_HI = [{"role": "user", "content": "hi"}]
_DEEP = '{"model": "deepseek-flash", "x": ' + "[" * 129 + "]" * 129 + "}"


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", _DEEP, "nested deeper than 128"),
        ("/v1/chat/completions", "[" * 100_000 + "]" * 100_000, "nested deeper than 128"),
        ("/v1/chat/completions", json.dumps({"model": "deepseek-flash", "messages": _HI, "seed": 2**64}),
         "seed: must be in [0, 2^64)"),
        ("/v1/completions", json.dumps({"model": "deepseek-flash", "prompt": "def f(", "seed": 2**64 + 5}),
         "seed: must be in [0, 2^64)"),
    ],
)  # fmt: skip
def test_client_mistakes_are_400_naming_the_field(served_without_keys, path, body, needle):
    """Issue 33.7: a body nested 129+ deep and a seed >= 2^64 were HTTP 500 (the FIM route took the seed
    modulo 2^32 without a word)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        served_without_keys.base + path, data=body.encode(), headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    assert needle in e.value.read().decode()


def test_a_body_over_the_limit_is_413_before_parsing(served_without_keys):
    """Issue 33.4: the HTTP API had no body limit (a 50 MB message took 172 s before its 400). Checked
    on the raw bytes as they arrive, with and without Content-Length."""
    import urllib.error
    import urllib.request

    http = served_without_keys.server.http
    # The default: the gRPC limits' equivalent, with the image term since this model takes images.
    assert http.body_limit() == 4 * (1 << 20) + (1 << 20) + -(-4 * 16 * (20 << 20) // 3)
    default = http.config
    http.config = dataclasses.replace(default, http_max_body_bytes=4096)
    try:
        url = served_without_keys.base + "/v1/chat/completions"
        message = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "a" * 5000}]}
        big = json.dumps(message).encode()
        for chunked in (False, True):
            data = iter([big[i : i + 1024] for i in range(0, len(big), 1024)]) if chunked else big
            headers = {"content-type": "application/json"}
            if chunked:
                headers["transfer-encoding"] = "chunked"
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60)
            assert e.value.code == 413 and "http_max_body_bytes = 4096" in e.value.read().decode()
        small = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        req = urllib.request.Request(
            url, data=json.dumps(small).encode(), headers={"content-type": "application/json"}
        )
        assert urllib.request.urlopen(req, timeout=60).status == 200
    finally:
        http.config = default


def test_the_field_blamed_for_a_serde_error_is_found_by_halves():
    """Issue 33.4: naming the field re-converted the body once per key (6,000 unknown keys and one wrong
    type: 13 s). Now by halves: about log2(n) conversions, the same field named."""
    from serving.http.convert import _blame

    conversions = []

    class Request:  # deepseek-recipe's role: fails with the unnamed serde message while `temperature` is bad
        def __init__(self, body):
            self.body = body

        def convert(self, opts):
            conversions.append(len(self.body))
            if self.body.get("temperature") == "hot":
                raise ValueError("invalid request body: invalid type: string, expected f32")

    body = {"model": "m", **{f"unknown_{i}": i for i in range(3000)}, "temperature": "hot"}
    body.update({f"later_{i}": i for i in range(3000)})
    message = "invalid request body: invalid type: string, expected f32"
    assert _blame(Request, body, None, message) == "temperature: invalid type: string, expected f32"
    assert len(conversions) <= 15  # log2(6,001) + 2; it was one per key

    class Always(Request):  # an error no top-level field causes
        def convert(self, opts):
            raise ValueError(message)

    assert _blame(Always, body, None, message) == "request body: invalid type: string, expected f32"


def test_a_full_server_answers_429_before_reading_or_preparing_the_body(served_without_keys, monkeypatch):
    """Issue 33.4: the concurrency gate was taken only after the body was read and prepared, so an
    overloaded server did that work for requests it then refused."""
    import urllib.error
    import urllib.request

    http = served_without_keys.server.http
    prepared = []
    real = http.converter.prepare
    monkeypatch.setattr(http.converter, "prepare", lambda *a, **k: prepared.append(1) or real(*a, **k))
    limits = http.admission.limits
    http.admission.limits = dataclasses.replace(limits, max_concurrent=1)
    http.admission._in_flight["default"] += 1  # one request in flight: the limit
    try:
        body = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        req = urllib.request.Request(
            served_without_keys.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
        assert prepared == []
    finally:
        http.admission._in_flight["default"] -= 1
        http.admission.limits = limits
    assert urllib.request.urlopen(req, timeout=60).status == 200 and prepared == [1]


def test_a_prompt_over_max_prompt_bytes_is_400_before_tokenizing(served_without_keys):
    """Issue 33.4: a 10 MB message was tokenized (minutes on a shared pool) before any limit; now the
    rendered prompt is held to max_prompt_bytes, as gRPC's prompt is."""
    import urllib.error
    import urllib.request

    url = served_without_keys.base
    for path, body, field in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (1 << 20)}]}, "messages"),
        ("/v1/completions", {"prompt": "def f(", "suffix": "é" * (1 << 19)}, "prompt"),
    ):
        req = urllib.request.Request(
            url + path, data=json.dumps({"model": "deepseek-flash", **body}).encode(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400
        assert (
            f"{field}: the prompt has" in (text := e.value.read().decode())
            and "max_prompt_bytes = 1048576" in text
        )


def test_a_prompt_certainly_longer_than_the_context_is_400_before_tokenizing(
    served_without_keys, monkeypatch
):
    """Issue 33.4 (measured with bench/soak.py's tenant phase): a message just under max_prompt_bytes
    was tokenized (a core for 1.3 s) only to be refused for the context (1024 tokens here). A prompt of
    n bytes is at least n / (4 x the longest token's bytes) tokens; past the context that is a 400
    before tokenizing. A prompt that fits is still tokenized and answered."""
    import urllib.error
    import urllib.request

    conv = served_without_keys.server.http.converter
    encoded = []
    real = conv.encoder.plain
    monkeypatch.setattr(conv.encoder, "plain", lambda text: encoded.append(len(text)) or real(text))
    bound = conv._bytes_per_token_bound
    for path, body, field in (
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * (1024 * bound)}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": "def f(", "suffix": "x" * (1024 * bound)}, "prompt"),
    ):
        req = urllib.request.Request(
            served_without_keys.base + path, data=json.dumps({"model": "deepseek-flash", **body}).encode(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        text = e.value.read().decode()
        assert e.value.code == 400 and f"{field}: This model's maximum context length is 1024" in text, text
        assert "resulted in at least" in text and encoded == []
    small = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(
        served_without_keys.base + "/v1/chat/completions", data=json.dumps(small).encode(),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert urllib.request.urlopen(req, timeout=60).status == 200 and encoded


@pytest.mark.parametrize("tokenizer_file", [GOLDEN / "tokenizer.json", TINY_TOKENIZER])
def test_the_tokens_lower_bound_never_exceeds_the_real_count(tokenizer_file):
    """The bound behind the early 400: for texts of the longest tokens, of fullwidth letters (NFKC
    shortens them), of CJK, emoji and mixed text, the real token count is never below it."""
    hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    conv = Converter(hf, catalog=ModelCatalog(), max_context=64, max_tokens_limit=8, max_logprobs=0)
    vocab = hf.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=lambda t: len(t.encode("utf-8")))[-20:]
    texts = [
        "".join(longest) * 20,
        "ＡＢＣＤ" * 500,
        "数据模型" * 400,
        "🙂🚀" * 300,
        "Hello, wörld! " * 300,
        " " * 5000,
    ]
    for text in texts:
        n = len(hf.encode(text, add_special_tokens=False).ids)
        assert n >= -(-len(text.encode("utf-8")) // conv._bytes_per_token_bound), (text[:20], n)
