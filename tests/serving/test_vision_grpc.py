"""Images over real gRPC (`GenerateRequest.images`) on the tiny-v model: bytes and Files API ids, the
usage count of an image span, greedy output against the notebook API (`Model.generate(text,
images=...)`), and every refusal as INVALID_ARGUMENT naming the field, with nothing left held."""

from __future__ import annotations

import asyncio
import io
import threading
from pathlib import Path

import grpc
import pytest
from PIL import Image, ImageOps
from serving_helpers import ServerThread

import ced_jax
from serving import client
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.proto import ced_pb2
from serving.server import Server
from serving.vision import warm_vision_encoder

pytestmark = pytest.mark.timeout(600)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"
PLACEHOLDER = "<｜deepseek_image｜>"
TEXT = f"<｜User｜>Look at this picture{PLACEHOLDER}and say what you see.<｜Assistant｜></think>"
IMAGE1 = (GOLDEN / "image1.png").read_bytes()
MAX_IMAGES = 2


def _config(**kw) -> ServeConfig:
    base = dict(http_port=0,
        max_slots=4, page_size=16, max_context=512, prefill_buckets=(64,), max_tokens_limit=32,
        default_max_tokens=8, max_queued=16, metrics_port=None, max_images_per_request=MAX_IMAGES,
        max_image_bytes=1 << 20,
    )  # fmt: skip
    base.update(kw)
    return ServeConfig(**base)


@pytest.fixture(scope="module")
def model():
    return ced_jax.load(GOLDEN)


@pytest.fixture(scope="module")
def server(model):
    engine = JaxEngine(model, _config())
    # Compiled here, without ServerThread's 30 s limit on start(); start() then warms up again (every
    # program already compiled in this process).
    engine.warmup()
    warm_vision_encoder(model.vision, model.cfg.vision)
    srv = ServerThread(engine, ModelTokenizer(model), _config())
    assert srv.server.http is not None
    yield srv
    srv.close()


def _generate(addr: str, prompt, images, **kw):
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120) | kw
    return client.generate(addr, prompt, images=images, **kw)


def _refused(addr: str, prompt, images, **kw) -> str:
    with pytest.raises(grpc.RpcError) as e:
        _generate(addr, prompt, images, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value.details()


def test_image_data_request_counts_its_span(server, model):
    ids, _, _ = model.encode_vl(TEXT, [IMAGE1])  # BOS + text with the span, as the notebook API
    text_only = model.encode(TEXT.replace(PLACEHOLDER, ""))
    out = _generate(server.addr, TEXT, [IMAGE1])
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert out.usage.prompt_tokens == len(ids) > len(text_only) + 3  # a span is START ... END
    assert server.server.images is not None and server.server.images.vit_runs >= 1
    info = client.model_info(server.addr)
    assert info.accepts_images and info.limits.max_images_per_request == MAX_IMAGES
    assert info.limits.max_image_bytes == 1 << 20
    server.assert_idle()


def test_greedy_image_request_is_the_notebook_api(server, model):
    want = model.generate(TEXT, max_tokens=8, images=[IMAGE1], stop_at_eos=False)
    out = _generate(server.addr, TEXT, [IMAGE1])
    assert out.token_ids == want["token_ids"]
    # The picture reaches the output: another picture (same size) is another prompt.
    buf = io.BytesIO()
    ImageOps.mirror(Image.open(io.BytesIO(IMAGE1)).convert("RGB")).save(buf, format="PNG")
    mirrored = _generate(server.addr, TEXT, [buf.getvalue()])
    assert mirrored.usage.prompt_tokens == out.usage.prompt_tokens
    want_mirrored = model.generate(TEXT, max_tokens=8, images=[buf.getvalue()], stop_at_eos=False)
    assert mirrored.token_ids == want_mirrored["token_ids"]
    assert want_mirrored["token_ids"] != want["token_ids"], "the picture does not reach the output"
    server.assert_idle()


def test_file_id_is_the_same_image_and_is_leased(server):
    files = server.server.files
    record = files.upload("alice", IMAGE1, filename="image1.png", purpose="vision")
    hits = server.server.images.cache_hits
    by_file = _generate(server.addr, TEXT, [record.id], user="alice")
    by_data = _generate(server.addr, TEXT, [IMAGE1], user="alice")
    assert by_file.token_ids == by_data.token_ids
    assert by_file.usage.prompt_tokens == by_data.usage.prompt_tokens
    assert server.server.images.cache_hits >= hits + 1  # one picture: the ViT ran at most once
    assert files.get("alice", record.id).leases == 0  # released when the request ended
    # Another identity's file reads as unknown; so does a made-up id.
    details = _refused(server.addr, TEXT, [record.id], user="bob")
    assert details.startswith("images[0].file_id: ") and record.id in details
    details = _refused(server.addr, TEXT, ["file-nope"], user="alice")
    assert details.startswith("images[0].file_id: ") and "file-nope" in details
    files.delete("alice", record.id)
    assert files.stored_bytes == 0
    server.assert_idle()


def test_bad_images_are_invalid_argument_and_hold_nothing(server):
    pool = server.scheduler.pool
    free = pool.num_free
    two = TEXT.replace(PLACEHOLDER, PLACEHOLDER * 2)
    details = _refused(server.addr, two, [IMAGE1, b"\x89PNG\r\n\x1a\n not really"])
    assert details.startswith("images[1].data: "), details
    details = _refused(server.addr, TEXT, [IMAGE1[:100]])
    assert details.startswith("images[0].data: "), details
    details = _refused(server.addr, TEXT, [b"\0" * ((1 << 20) + 1)])
    assert details.startswith("images[0].data: ") and str(1 << 20) in details, details
    three = TEXT.replace(PLACEHOLDER, PLACEHOLDER * 3)
    details = _refused(server.addr, three, [IMAGE1] * 3)
    assert details.startswith("images: ") and "3" in details and str(MAX_IMAGES) in details, details
    details = _refused(server.addr, TEXT, [IMAGE1, IMAGE1])
    assert details.startswith("images: ") and "placeholder" in details, details
    details = _refused(server.addr, [1, 2, 3], [IMAGE1])
    assert "images" in details and "prompt_token_ids" in details, details
    request = ced_pb2.GenerateRequest(prompt=TEXT, images=[ced_pb2.ImageInput()])
    with pytest.raises(grpc.RpcError) as e, grpc.insecure_channel(server.addr) as channel:
        list(client.ced_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("images[0]: ")
    assert pool.num_free == free
    server.assert_idle()


def test_images_to_a_text_only_model_are_invalid_argument():
    """The `tiny` preset has no vision tower: refused before anything reaches the engine (so it is
    not even warmed up here)."""
    text_model = ced_jax.load("tiny")
    assert text_model.vision is None
    config = _config(max_context=128)
    engine = JaxEngine(text_model, config)

    async def start() -> Server:
        srv = Server(config)
        await srv.start(engine, ModelTokenizer(text_model), warmup=False)
        return srv

    loop = asyncio.new_event_loop()
    try:
        srv = loop.run_until_complete(start())
        assert srv.images is None
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            info = client.model_info(srv.address)
            assert not info.accepts_images and info.limits.max_images_per_request == 0
            details = _refused(srv.address, "a picture <｜deepseek_image｜>", [IMAGE1])
            assert details.startswith("images: ") and "vision" in details, details
            assert srv.scheduler.pool.num_referenced == 0
        finally:
            asyncio.run_coroutine_threadsafe(srv.shutdown(0.0), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
    finally:
        loop.close()


def test_http_front_end_shares_the_pipeline_and_the_file_store(server, tmp_path, capsys):
    """A file uploaded over HTTP is usable over gRPC (one FileStore), the HTTP API expands images with
    the server's pipeline (its feature cache is hit), and `ced-jax client --image` sends one."""
    import base64
    import json
    import urllib.request

    base = f"http://127.0.0.1:{server.server.http_port}"
    boundary = "cedboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nvision\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + IMAGE1
        + f"\r\n--{boundary}--\r\n".encode()
    )
    upload = urllib.request.Request(
        base + "/v1/files", data=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    with urllib.request.urlopen(upload, timeout=30) as r:
        file_id = json.loads(r.read())["id"]
    by_file = _generate(server.addr, TEXT, [file_id])  # no API keys: HTTP files belong to identity ""
    by_data = _generate(server.addr, TEXT, [IMAGE1])
    assert by_file.token_ids == by_data.token_ids

    pipeline = server.server.images
    hits = pipeline.cache_hits
    url = "data:image/png;base64," + base64.b64encode(IMAGE1).decode()
    chat = {
        "model": "deepseek-chat",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Look at this picture"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
    }  # fmt: skip
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(chat).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        usage = json.loads(r.read())["usage"]
    assert pipeline.cache_hits == hits + 1  # the same pixels: no ViT run
    # The span counts in the HTTP usage too (the chat template's text differs from TEXT's).
    text_only = server.scheduler.tokenizer.encode(TEXT.replace(PLACEHOLDER, ""))
    assert usage["prompt_tokens"] > by_data.usage.prompt_tokens - len(text_only)

    path = tmp_path / "a.png"
    path.write_bytes(IMAGE1)
    rc = client.main([server.addr, "--prompt", TEXT, "--image", str(path), "--max-tokens", "3",
                      "--temperature", "0", "--ignore-eos"])  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert f"prompt_tokens={by_data.usage.prompt_tokens} " in err, err
    server.assert_idle()


def test_serve_image_flags_reach_the_config():
    from ced_cli.main import build_parser
    from ced_cli.serve import serve_config

    def options(*flags: str) -> ServeConfig:
        return serve_config(build_parser().parse_args(["serve", "tiny", *flags]))

    default = options()
    assert (default.feature_cache_bytes, default.max_images_per_request, default.max_image_bytes) == (
        256 << 20, 16, 20 << 20,
    )  # fmt: skip
    assert not default.http_image_fetch.allow_image_urls
    cfg = options(
        "--feature-cache-bytes", "0", "--max-images-per-request", "3", "--max-image-bytes", "1000",
        "--allow-image-urls", "img.example.com,cdn:8080", "--files-ttl", "60",
        "--files-max-file-bytes", "500",
    )  # fmt: skip
    assert (cfg.feature_cache_bytes, cfg.max_images_per_request, cfg.max_image_bytes) == (0, 3, 1000)
    assert cfg.http_images.max_images_per_request == 3 and cfg.http_images.max_image_bytes == 1000
    assert cfg.http_image_fetch.allowed_hosts == ("img.example.com", "cdn:8080")
    assert cfg.http_files.ttl_s == 60 and cfg.http_files.max_file_bytes == 500
    for flags, named in (
        (["--max-images-per-request", "0"], "--max-images-per-request"),
        (["--feature-cache-bytes", "-1"], "--feature-cache-bytes"),
        (["--allow-image-urls", ","], "--allow-image-urls"),
        (["--files-max-file-bytes", "10", "--files-max-total-bytes", "5"], "--files-max-file-bytes"),
    ):
        with pytest.raises(ValueError, match=named):
            options(*flags)
    with pytest.raises(ValueError, match="max_image_bytes"):
        ServeConfig(max_image_bytes=0)
