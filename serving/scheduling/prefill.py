"""Prefill planning (`scheduler.py`'s module docstring, step 3): which prefilling requests' chunks go
into a step's prefill call and where each chunk ends, and the image rows of a chunk's positions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from serving.engine.protocol import EngineSpec
from serving.scheduling.prefix import images_in
from serving.vision import RequestImage


class Prefilling(Protocol):
    prompt: np.ndarray
    prefilled: int  # prompt tokens computed so far
    slot: int
    images: Sequence[RequestImage]


PrefillingT = TypeVar("PrefillingT", bound=Prefilling)


def plan_prefill(
    prefilling: Sequence[PrefillingT], decoding: bool, spec: EngineSpec, rows: int, token_budget: int
) -> list[tuple[PrefillingT, int]]:
    """(request, chunk end) of a step's prefill over the `prefilling` requests (oldest first): at most
    `rows` requests, each chunk at most the largest bucket, together at most `token_budget` tokens
    while a stream is `decoding` (none: every row's largest chunk, or the oldest request's long text
    prompt alone in a chunk of up to `long_prefill_chunk`). The budget is handed out a page
    per request in turn, so the chunks end up about equally long: a batched prefill runs as many
    page iterations as its longest chunk has pages. Every chunk but a prompt's last ends on a page
    boundary (the next one must start on one)."""
    ps, max_chunk = spec.page_size, spec.max_chunk
    budget = token_budget
    long_chunk = spec.long_prefill_chunk
    if long_chunk and not decoding and prefilling:
        # Nobody waits: the oldest request's long text prompt goes alone in large chunks
        # (EngineSpec.long_prefill_chunk; a multiple of page_size, so the next starts on a page).
        seq = prefilling[0]
        left = len(seq.prompt) - seq.prefilled
        if left > max_chunk and not seq.images:
            return [(seq, seq.prefilled + min(left, long_chunk))]
    if not decoding:
        budget = max(budget, rows * max_chunk)
    seqs = list(prefilling[:rows])
    blocks = spec.kv_blocks
    if blocks > 1:  # data-parallel attention: each device block runs rows / blocks of them
        per_slot, per_rows = spec.max_slots // blocks, rows // blocks
        taken: Counter[int] = Counter()
        seqs = []
        for seq in prefilling:
            if taken[seq.slot // per_slot] < per_rows:
                taken[seq.slot // per_slot] += 1
                seqs.append(seq)
    ends = [s.prefilled for s in seqs]
    progress = True
    while progress and budget > 0:
        progress = False
        for i, seq in enumerate(seqs):
            n = len(seq.prompt)
            take = min(ps, n - ends[i], seq.prefilled + max_chunk - ends[i])
            if take <= 0 or take > budget:
                continue
            ends[i] += take
            budget -= take
            progress = True
    return [(seq, end) for seq, end in zip(seqs, ends, strict=True) if end > seq.prefilled]


def chunk_images(images: Sequence[RequestImage], start: int, end: int, width: int):
    """(token_types i32 [end - start], span_embeds f32 [end - start, width]) of a chunk's positions,
    or (None, None) when no span reaches into it."""
    spans = images_in(images, start, end)
    if not spans:
        return None, None
    types = np.full(end - start, -1, np.int32)
    rows = np.zeros((end - start, width), np.float32)
    for im in spans:
        a, b = max(start, im.start), min(end, im.end)
        types[a - start : b - start] = im.token_types[a - im.start : b - im.start]
        rows[a - start : b - start] = im.span_embeds[a - im.start : b - im.start]
    return types, rows
