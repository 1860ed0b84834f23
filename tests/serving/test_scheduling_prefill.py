"""serving/scheduling/prefill.py on its own: how a step's prefill budget is shared among the prefilling
requests, the long-prompt chunk, and the image rows of a chunk."""

from types import SimpleNamespace

import numpy as np

from serving.engine.protocol import EngineSpec
from serving.scheduling.prefill import chunk_images, plan_prefill
from serving.vision import RequestImage


def _spec(**kw):
    return EngineSpec(
        max_slots=4, page_size=4, num_pages=64, max_context=64, prefill_buckets=(4, 8, 16), vocab_size=256,
        eos_token_ids=(0,), max_logprobs=0, **kw,
    )  # fmt: skip


def _seq(name, n, prefilled=0, slot=0, images=()):
    return SimpleNamespace(
        name=name, prompt=np.zeros(n, np.int32), prefilled=prefilled, slot=slot, images=images
    )


def _ends(plan):
    return [(s.name, end) for s, end in plan]


def test_the_budget_goes_a_page_per_request_in_turn_while_others_decode():
    a, b = _seq("a", 10), _seq("b", 30, slot=1)
    assert _ends(plan_prefill([a, b], True, _spec(), rows=4, token_budget=12)) == [("a", 8), ("b", 4)]
    assert _ends(plan_prefill([a, b], True, _spec(), rows=1, token_budget=12)) == [("a", 10)]


def test_nobody_decoding_every_row_gets_its_largest_chunk():
    a, b = _seq("a", 10), _seq("b", 30, prefilled=4, slot=1)
    assert _ends(plan_prefill([a, b], False, _spec(), rows=4, token_budget=4)) == [("a", 10), ("b", 20)]


def test_a_long_text_prompt_goes_alone_in_a_long_chunk():
    a, b = _seq("a", 60), _seq("b", 10, slot=1)
    spec = _spec(long_prefill_chunk=32)
    assert _ends(plan_prefill([a, b], False, spec, rows=4, token_budget=8)) == [("a", 32)]
    assert _ends(plan_prefill([a, b], True, spec, rows=4, token_budget=8)) == [("a", 4), ("b", 4)]


def test_each_device_block_prefills_its_share_of_the_rows():
    # Data-parallel attention over 2 blocks: slots 0, 1 on block 0, 2, 3 on block 1; 2 rows, 1 each.
    a, b, c = _seq("a", 8, slot=0), _seq("b", 8, slot=1), _seq("c", 8, slot=2)
    spec = _spec(kv_blocks=2)
    assert _ends(plan_prefill([a, b, c], False, spec, rows=2, token_budget=8)) == [("a", 8), ("c", 8)]


def test_chunk_images_fill_only_the_positions_a_span_covers():
    types = np.array([0, 1, 3], np.int32)
    im = RequestImage(5, types, np.arange(6, dtype=np.float32).reshape(3, 2), b"h" * 32)  # [5, 8)
    assert chunk_images([im], 0, 4, 2) == (None, None)
    got_types, rows = chunk_images([im], 4, 7, 2)
    assert got_types.tolist() == [-1, 0, 1] and rows.tolist() == [[0, 0], [0, 1], [2, 3]]
