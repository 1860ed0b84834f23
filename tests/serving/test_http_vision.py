"""Images over the HTTP API end to end on the tiny-v model (JaxEngine, ViT, the server's ImagePipeline),
through the official SDKs over localhost.

The request is the tiny-v fixture's conversation (system + a user turn with two pictures, non-thinking):
sent as OpenAI Chat with base64 data URLs, as OpenAI Chat with Files API ids, and as Anthropic Messages
with base64 blocks, it must be served with `prompt_tokens` equal to the fixture's prompt length (each image
counted as its span, DeepSeek's own ids), greedy output equal across the three forms, the ViT run once per
distinct picture (the feature cache is keyed by pixels, not by how the bytes came), and the files freed.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import anthropic
import openai
import pytest
from serving_helpers import ServerThread, wait_until

import ced_jax
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.tenants import ApiKeys

pytestmark = pytest.mark.timeout(600)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"
INPUTS = json.loads((GOLDEN / "inputs.json").read_text())
IMAGES = [(GOLDEN / name).read_bytes() for name in INPUTS["image_files"]]
SYSTEM = INPUTS["messages"][0]["content"]
TEXTS = [p["text"] for p in INPUTS["messages"][1]["content"] if p["type"] == "text"]
NO_THINKING = {"thinking": {"type": "disabled"}}
KEY = "sk-vision-0123456789"


@pytest.fixture(scope="module")
def server():
    model = ced_jax.load(GOLDEN)
    config = ServeConfig(
        max_slots=4, page_size=16, max_context=512, prefill_buckets=(64,), max_tokens_limit=32,
        default_max_tokens=8, max_queued=16, metrics_port=None, http_port=0,
        api_keys=ApiKeys.parse([f"{KEY} tester"]),
    )  # fmt: skip
    engine = JaxEngine(model, config)
    engine.warmup()  # compiles here: ServerThread gives start() 30 s
    st = ServerThread(engine, ModelTokenizer(model), config)
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    yield st
    st.close()


def _parts(images: list[dict]) -> list[dict]:
    return [
        {"type": "text", "text": TEXTS[0]},
        images[0],
        {"type": "text", "text": TEXTS[1]},
        images[1],
        {"type": "text", "text": TEXTS[2]},
    ]


def _chat(oai: openai.OpenAI, images: list[dict]):
    return oai.chat.completions.create(
        model="deepseek-flash",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": _parts(images)}],
        max_tokens=6,
        temperature=0,
        extra_body={**NO_THINKING, "ignore_eos": True},
    )


def test_base64_file_id_and_anthropic_block_are_served_with_span_usage(server):
    oai = openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=300)
    b64 = [base64.b64encode(b).decode() for b in IMAGES]
    pipeline = server.server.images
    assert pipeline is not None
    runs_before = pipeline.vit_runs

    by_data = _chat(
        oai, [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{s}"}} for s in b64]
    )
    assert by_data.usage.prompt_tokens == len(INPUTS["prompt_ids"])  # spans, not one token per image
    assert pipeline.vit_runs == runs_before + 2

    ids = [oai.files.create(file=(f"{i}.png", b), purpose="vision").id for i, b in enumerate(IMAGES)]
    by_file = _chat(oai, [{"type": "file", "file": {"file_id": i}} for i in ids])
    assert by_file.usage.prompt_tokens == len(INPUTS["prompt_ids"])
    assert by_file.choices[0].message.content == by_data.choices[0].message.content

    claude = anthropic.Anthropic(base_url=f"{server.base}/anthropic", api_key=KEY, max_retries=0, timeout=300)
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": s}} for s in b64
    ]
    msg = claude.messages.create(
        model="deepseek-flash",
        max_tokens=6,
        system=SYSTEM,
        messages=[{"role": "user", "content": _parts(blocks)}],
        extra_body={**NO_THINKING, "ignore_eos": True, "temperature": 0},
    )
    # Anthropic's input_tokens leave out prompt-cache reads (the same prompt was served just before).
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(INPUTS["prompt_ids"])
    assert msg.content[0].text == by_data.choices[0].message.content
    # The same two pictures, three ways: the ViT ran for the first request only.
    assert pipeline.vit_runs == runs_before + 2

    for i in ids:
        oai.files.delete(i)
    wait_until(lambda: server.server.http.files.stored_bytes == 0, timeout=5)
    server.assert_idle()
