"""Where a queued request goes when the scheduler admits it (`scheduler.py`'s module docstring, steps
2 and 4): how many pages it reserves, which slot (and, under data-parallel attention, which device
block) it takes, and which decoding requests yield their slots to waiting ones. (HTTP requests are
limited before they reach the scheduler: `serving/admission.py`.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


def reserved_pages(
    prompt_len: int, tokens_left: int, draft_positions: int, page_size: int, pages_per_slot: int
) -> int:
    """The pages a request holds from its admission to its finish, for its worst case: KV of every
    position but the last sampled token's, plus the `draft_positions` (DSpark's K) the engine may
    write past a row's last token; at most a slot's pages (max_context)."""
    return min(-(-(prompt_len + tokens_left - 1 + draft_positions) // page_size), pages_per_slot)


class FreeSlots:
    """The engine slots no request holds, lowest first; under data-parallel attention the slots are
    split evenly over `blocks` device blocks, each reading only its own block's pages."""

    def __init__(self, max_slots: int, blocks: int):
        self.blocks = blocks
        self._per_block = max_slots // blocks
        self._free = list(range(max_slots))

    def __bool__(self) -> bool:
        return bool(self._free)

    def pick_block(self, prefix_block: int | None, available_in: Callable[[int], int]) -> int | None:
        """The device block a request runs on: `prefix_block` (the block holding its cached prefix) if
        that block has a free slot, else the block with a free slot and the most available pages
        (`available_in(block)`; the lowest of equals). None with one block."""
        if self.blocks == 1:
            return None
        open_blocks = sorted({s // self._per_block for s in self._free})
        if prefix_block is not None and prefix_block in open_blocks:
            return prefix_block
        return max(open_blocks, key=lambda b: (available_in(b), -b))

    def take(self, block: int | None) -> int:
        """The lowest free slot (of `block`, under data-parallel attention)."""
        if block is None:
            return self._free.pop(0)
        slot = next(s for s in self._free if s // self._per_block == block)
        self._free.remove(slot)
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()


class Segment(Protocol):
    generated: int  # tokens generated so far
    segment_from: int  # `generated` when the request last got a slot


SegmentT = TypeVar("SegmentT", bound=Segment)


def yield_order(decoding: Sequence[SegmentT], segment_tokens: int) -> list[SegmentT]:
    """The decoding requests that have generated `segment_tokens` (`ServeConfig.decode_segment_tokens`)
    since they got their slot, in the order they yield to waiting requests: most generated first."""
    due = [s for s in decoding if s.generated - s.segment_from >= segment_tokens]
    due.sort(key=lambda s: s.generated - s.segment_from, reverse=True)
    return due
