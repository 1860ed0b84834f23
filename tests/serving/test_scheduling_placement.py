"""serving/scheduling/placement.py on its own: the pages a request reserves, the slot and device block
it takes, and the order in which decoding requests yield their slots."""

from types import SimpleNamespace

from serving.scheduling.placement import FreeSlots, reserved_pages, yield_order


def test_reserved_pages_cover_the_worst_case_within_a_slot():
    # 7 prompt + 5 to generate - 1 (the last token's KV is never written) = 11 positions: 3 pages of 4
    assert reserved_pages(7, 5, 0, 4, 16) == 3
    assert reserved_pages(7, 5, 4, 4, 16) == 4  # DSpark K = 4 positions past the last token
    assert reserved_pages(60, 40, 0, 4, 16) == 16  # never more than a slot holds (max_context)


def test_free_slots_hand_out_the_lowest_first():
    free = FreeSlots(4, 1)
    assert [free.take(None), free.take(None)] == [0, 1]
    free.give_back(0)
    assert free.take(None) == 0
    assert free.pick_block(None, lambda b: 0) is None  # one device block: nothing to pick
    free.take(None), free.take(None)
    assert not free


def test_free_slots_pick_the_prefix_block_else_the_emptiest():
    free = FreeSlots(4, 2)  # slots 0, 1 on block 0; 2, 3 on block 1
    pages = {0: 5, 1: 9}
    assert free.pick_block(0, pages.get) == 0  # its cached prefix is there and a slot is free
    assert free.pick_block(None, pages.get) == 1  # else the most available pages
    assert free.pick_block(None, {0: 3, 1: 3}.get) == 0  # the lowest of equals
    assert free.take(1) == 2 and free.take(1) == 3
    assert free.pick_block(1, pages.get) == 0  # block 1 has no free slot left
    assert free.take(0) == 0


def test_yield_order_takes_requests_past_their_segment_most_generated_first():
    seqs = [SimpleNamespace(name=n, generated=g, segment_from=f) for n, g, f in
            [("a", 10, 0), ("b", 30, 25), ("c", 40, 8), ("d", 20, 12)]]  # fmt: skip
    assert [s.name for s in yield_order(seqs, 8)] == ["c", "a", "d"]
    assert yield_order(seqs, 100) == []
