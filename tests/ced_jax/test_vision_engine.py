"""Image spans through the engine's programs (`ced_jax.engine`): the text program and the image
variant agree bit for bit on text, and an image prompt prefilled page by page in the batched
prefill program (the server's) matches the one-shot notebook path.

The fixture is the vision golden fixture (`--vision-golden DIR`, default tests/golden/tiny-v); its
prompt, token types and span embeddings (`prefill_embed_output` at span positions) are the inputs,
so these tests do not depend on the ViT. Every shape is derived from the fixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from ced_jax import cache as cache_lib
from ced_jax.api import load
from ced_jax.engine import Engine, SamplingBatch, StateShapes

PAGE = 16
ROWS = 2
LOGPROB_ATOL = 4e-6  # a few float32 ulps at |log p| ~ 5


@pytest.fixture(scope="module")
def fixture_dir(request) -> Path:
    return Path(request.config.getoption("vision_golden"))


@pytest.fixture(scope="module")
def golden(fixture_dir):
    g = load_file(str(fixture_dir / "expected.safetensors"))
    inputs = json.loads((fixture_dir / "inputs.json").read_text())
    ids = np.asarray(g["prompt_ids"] if "prompt_ids" in g else inputs["prompt_ids"], np.int32)
    types = np.asarray(g["token_types"] if "token_types" in g else inputs["token_types"], np.int32)
    merged = g["prefill_embed_output"] if "prefill_embed_output" in g else g["prefill_block_input"][0][:, 0]
    spans = np.where((types >= 0)[:, None], merged, 0.0).astype(np.float32)
    return {"ids": ids, "types": types, "spans": spans}


@pytest.fixture(scope="module")
def model(fixture_dir):
    return load(str(fixture_dir))


def _width(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _engine(model, context: int) -> Engine:
    pages = ROWS * context // PAGE
    return Engine(
        model.loaded, StateShapes(max_slots=ROWS, page_size=PAGE, num_pages=pages, max_context=context)
    )


def _prefill(engine: Engine, tokens, n, *, types=None, spans=None, max_logprobs=8):
    page_tables = cache_lib.contiguous_page_tables(ROWS, engine.shapes.pages_per_slot)
    out = engine.prefill_batch(
        np.arange(ROWS), tokens, n, np.zeros(ROWS, np.int32), page_tables,
        SamplingBatch.broadcast(ROWS), max_logprobs=max_logprobs, token_types=types, span_embeds=spans,
    )  # fmt: skip
    return jax.device_get(out)


def _assert_trees_identical(a, b, what: str) -> None:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b, what
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


@pytest.mark.slow  # both prefill programs (text and image variant) to compile: minutes on 2 cores
def test_text_chunks_are_bit_identical_through_the_image_variant(model, golden):
    """A text chunk (token types all -1) gives the same samples, log-probabilities, final state and
    Engram history through the image variant as through the text program, so the prefix-cache pages
    either computes are interchangeable."""
    ids = golden["ids"]
    width = _width(len(ids))
    tokens = np.full((ROWS, width), model.cfg.pad_token_id, np.int32)
    tokens[0, : len(ids)] = ids
    short = min(len(ids), 3 * PAGE + 5)
    tokens[1, :short] = ids[::-1][:short]
    n = np.array([len(ids), short], np.int32)
    context = _width(width + 1)
    text_engine, image_engine = _engine(model, context), _engine(model, context)
    text_out = _prefill(text_engine, tokens, n)
    image_out = _prefill(
        image_engine,
        tokens,
        n,
        types=np.full(tokens.shape, -1, np.int32),
        spans=np.zeros((*tokens.shape, model.cfg.hidden_size), np.float32),
    )
    _assert_trees_identical(text_out, image_out, "prefill_batch outputs")
    _assert_trees_identical(jax.device_get(text_engine.state), jax.device_get(image_engine.state), "state")
    np.testing.assert_array_equal(text_engine.history, image_engine.history)

    # The step program (notebook prefill chunks): logits and state.
    step_tokens = tokens[:, :PAGE]
    lens = np.full(ROWS, PAGE, np.int32)
    page_tables = cache_lib.contiguous_page_tables(ROWS, text_engine.shapes.pages_per_slot)
    results = []
    for engine, extra in (
        (_engine(model, context), {}),
        (
            _engine(model, context),
            dict(
                token_types=np.full(step_tokens.shape, -1, np.int32),
                span_embeds=np.zeros((*step_tokens.shape, model.cfg.hidden_size), np.float32),
            ),
        ),
    ):
        start = np.zeros(ROWS, np.int32)
        logits, aux = engine.step(step_tokens, start, lens, np.arange(ROWS), page_tables, **extra)
        results.append(jax.device_get((logits, aux, engine.state)))
    _assert_trees_identical(results[0], results[1], "step logits / decisions / state")


def test_image_prompt_in_the_batched_prefill_equals_page_steps(model, golden):
    """The fixture's image prompt as row 0 of the batched prefill program (the server's: a loop over
    pages inside one program, a text row beside it) against the same rows fed page by page through
    the step program with the same [rows, page] shape: bit-identical log-probabilities, state and
    Engram history, which carries DEAD slots exactly where the hasher puts them (image spans cross
    page boundaries here). (The one-shot notebook prefill of this prompt is not a bitwise reference:
    other GEMM shapes move bf16 ties, and the tiny model amplifies them, with or without images.)"""
    ids, types, spans = golden["ids"], golden["types"], golden["spans"]
    width = _width(len(ids))
    tokens = np.full((ROWS, width), model.cfg.pad_token_id, np.int32)
    tokens[0, : len(ids)] = ids
    tokens[1, :PAGE] = ids[:PAGE]
    n = np.array([len(ids), PAGE], np.int32)
    row_types = np.full(tokens.shape, -1, np.int32)
    row_types[0, : len(ids)] = types
    row_spans = np.zeros((*tokens.shape, model.cfg.hidden_size), np.float32)
    row_spans[0, : len(ids)] = spans
    context = _width(width + 1)
    batched = _engine(model, context)
    out = _prefill(batched, tokens, n, types=row_types, spans=row_spans)
    token, logprob, top_ids, top_logprobs = (np.asarray(a) for a in out)

    stepped = _engine(model, context)
    page_tables = cache_lib.contiguous_page_tables(ROWS, stepped.shapes.pages_per_slot)
    last = [None] * ROWS
    for off in range(0, width, PAGE):
        lens = np.clip(n - off, 0, PAGE).astype(np.int32)
        start = np.where(lens > 0, off, 0).astype(np.int32)
        cut = slice(off, off + PAGE)
        logits, _ = stepped.step(
            tokens[:, cut], start, lens, np.arange(ROWS), page_tables,
            token_types=row_types[:, cut], span_embeds=row_spans[:, cut],
        )  # fmt: skip
        logits = np.asarray(logits)
        for r in range(ROWS):
            if 0 <= n[r] - 1 - off < PAGE:
                last[r] = logits[r, n[r] - 1 - off]
    # The sampler's log-softmax runs inside its program: equal logits give log-probabilities equal
    # to a few ulps (a one-ulp logit change on this model moves later tokens' logits by > 1e-3).
    ref = np.asarray(jax.nn.log_softmax(np.stack(last), axis=-1))
    assert token.tolist() == np.argmax(np.stack(last), -1).tolist()
    np.testing.assert_allclose(logprob, np.take_along_axis(ref, token[:, None], 1)[:, 0], atol=LOGPROB_ATOL)
    np.testing.assert_allclose(top_logprobs, np.take_along_axis(ref, top_ids, 1), atol=LOGPROB_ATOL)
    _assert_trees_identical(jax.device_get(batched.state), jax.device_get(stepped.state), "state")
    np.testing.assert_array_equal(batched.history, stepped.history)
    if model.hasher is not None:
        want = model.hasher.next_history(
            model.hasher.empty_history(1), ids[None], np.array([len(ids)]), (types >= 0)[None]
        )
        np.testing.assert_array_equal(batched.history[0], want[0])


def test_image_inputs_are_checked(model, golden):
    engine = _engine(model, 2 * PAGE)
    tokens = np.zeros((ROWS, PAGE), np.int32)
    with pytest.raises(ValueError, match="together"):
        engine.image_inputs(tokens, np.full(tokens.shape, -1), None)
    with pytest.raises(ValueError, match="token_types"):
        engine.image_inputs(tokens, np.full((ROWS, PAGE + 1), -1), np.zeros((ROWS, PAGE, 1)))
    with pytest.raises(ValueError, match="token_types"):
        engine.image_inputs(tokens, np.full(tokens.shape, 4), np.zeros((ROWS, PAGE, model.cfg.hidden_size)))
    with pytest.raises(ValueError, match="span_embeds"):
        engine.image_inputs(tokens, np.full(tokens.shape, -1), np.zeros((ROWS, PAGE, 3)))
