"""serving/scheduling/speculation.py on its own: how many drafts each row verifies, at which width, and
the check of what a verify step emitted (`confident_length` is checked against the engine's rule in
test_serving_dspark.py)."""

import numpy as np
import pytest

from serving.engine.protocol import EngineSpec
from serving.scheduling.speculation import DraftBook, check_emitted


def _book(k=4, threshold=None, widths=(1, 2, 4)):
    spec = EngineSpec(
        max_slots=3, page_size=4, num_pages=32, max_context=64, prefill_buckets=(4,), vocab_size=256,
        eos_token_ids=(0,), max_logprobs=0,
        dspark_widths=widths, dspark_max_drafts=widths[-1],
    )  # fmt: skip
    return DraftBook(spec, k, threshold)


def test_a_row_without_drafts_still_gets_the_narrowest_width():
    book = _book()
    width, n = book.plan([(0, 10, 100), (2, 10, 100)])
    assert width == 1 and n.tolist() == [0, 0, 0]  # right after prefill: nothing to verify yet


def test_drafts_are_cut_by_tokens_left_and_the_width_by_the_pages():
    book = _book()
    book.keep(0, np.array([5, 6, 7, 8]), np.zeros(4))
    book.keep(1, np.array([1, 2, 3, 4]), np.zeros(4))
    width, n = book.plan([(0, 10, 100), (1, 3, 100)])
    assert width == 4 and n.tolist() == [4, 2, 0]  # row 1 may generate 3 more: 2 drafts + 1
    width, n = book.plan([(0, 10, 100), (1, 3, 2)])
    assert width == 2 and n.tolist() == [2, 2, 0]  # row 1's pages hold 2 positions past its token
    assert book.plan([(0, 10, 0)])[0] == 0  # not even the narrowest width fits: a plain step
    assert book.block(2).tolist() == [[5, 6], [1, 2], [0, 0]]
    book.forget([0, 1])
    assert book.plan([(0, 10, 100)])[1].tolist() == [0, 0, 0]


def test_k_and_the_confidence_threshold_limit_the_drafts():
    assert _book(k=2).widths == (1, 2)
    book = _book(threshold=0.5)
    book.keep(0, np.array([5, 6, 7, 8]), np.array([4.0, 4.0, -4.0, 4.0]))
    width, n = book.plan([(0, 10, 100)])
    assert width == 2 and n[0] == 2  # stops before the first unlikely draft


def test_check_emitted():
    check_emitted(0, 1, 0)
    check_emitted(0, 3, 2)
    for emitted in (0, 4):
        with pytest.raises(RuntimeError, match="slot 0: the engine emitted"):
            check_emitted(0, emitted, 2)
