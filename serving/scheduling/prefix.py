"""The prompt-prefix cache as the scheduler sees it (`scheduler.py`'s module docstring, steps 2 and 6):
the device pages' cache (`pages.PagePool`) continued in the host and disk KV tiers (`kv_tiers.TieredKV`).
Matching a prompt, restoring tier blocks into a request's pages, registering a request's full
blocks, demoting the blocks the device cache evicts, and the tiers' metrics."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.config import ServeConfig
from serving.engine.protocol import EngineProtocol
from serving.metrics import Metrics
from serving.scheduling.kv_tiers import BlockMeta, DiskTier, HostTier, TieredKV
from serving.scheduling.pages import ROOT_KEY, CacheEntry, PagePool, scope_tag
from serving.vision import RequestImage


class TieredPrefixCache:
    """The device prefix cache (`pool`) and, with `ServeConfig.kv_tiers`, the tiers below it (`tiers`,
    None without them or once closed). Blocks the device cache evicts are collected while an
    admission allocates pages and demoted by `demote_evicted` right after it."""

    def __init__(self, engine: EngineProtocol, config: ServeConfig, metrics: Metrics | None):
        spec = engine.spec
        self.engine = engine
        self.metrics = metrics
        self.page_size = spec.page_size
        self.tiers: TieredKV | None = None
        if config.kv_tiers:
            disk = None
            if config.kv_disk_dir is not None:
                disk = DiskTier(config.kv_disk_dir, config.kv_disk_bytes, engine.kv_fingerprint())
            self.tiers = TieredKV(HostTier(config.kv_host_bytes), disk)
        self._evicted: list[CacheEntry] = []
        self._promotions_seen = 0
        self._disk_events_seen: dict[str, int] = {}
        self.pool = PagePool(
            spec.num_pages,
            spec.page_size,
            enable_prefix_cache=config.enable_prefix_cache,
            on_evict=self._evicted.append if self.tiers is not None else None,
            blocks=spec.kv_blocks,
        )

    def device_match(
        self, prompt: np.ndarray, images: Sequence[RequestImage], scope: str
    ) -> list[CacheEntry]:
        """The device cache's entries for the prompt's leading blocks (never the block holding the
        last prompt token: its logits are needed)."""
        ps, n = self.page_size, len(prompt)
        extras = [block_extra(images, i * ps, ps) for i in range(n // ps)]
        match = self.pool.match(prompt, max_blocks=(n - 1) // ps, scope=scope, block_extras=extras)
        return list(match.entries)

    def match(
        self, prompt: np.ndarray, images: Sequence[RequestImage], scope: str, block: int | None = None
    ) -> tuple[list[CacheEntry], list[BlockMeta]]:
        """(the device cache's entries for the prompt's leading blocks, the lower tiers' blocks that
        continue them). Never the block holding the last prompt token (its logits are needed). With
        `block` (data-parallel attention) only the leading entries whose pages are in that device
        block count: a slot reads only its own device's pages."""
        ps, n = self.page_size, len(prompt)
        extras = [block_extra(images, i * ps, ps) for i in range(n // ps)]
        entries = self.device_match(prompt, images, scope)
        if block is not None:
            inside = [self.pool.block_of(e.page) == block for e in entries]
            entries = entries[: inside.index(False) if False in inside else len(entries)]
        if self.tiers is None:
            return entries, []
        parent = entries[-1].key if entries else ROOT_KEY
        chain = self.tiers.chain(
            parent, scope_tag(scope), prompt, ps,
            start_block=len(entries), max_blocks=(n - 1) // ps, block_extras=extras,
        )  # fmt: skip
        return entries, chain

    def prefetch(self, prompt: np.ndarray, images: Sequence[RequestImage], scope: str) -> None:
        """Reads the disk blocks continuing the prompt into host memory (in the background), so they
        are there when the request is admitted."""
        if self.tiers is None or self.tiers.disk is None:
            return
        _, chain = self.match(prompt, images, scope)
        if chain:
            self.tiers.prefetch([b.key for b in chain])

    def demote_evicted(self) -> None:
        """Demotes the blocks the device cache evicted since the last call; their pages are about to
        be rewritten (by this step's prefill), so it runs right after the allocation."""
        if self._evicted:
            self._demote(self.tiers, self._evicted)
            self._evicted.clear()

    def _demote(self, tiers: TieredKV, entries: Sequence[CacheEntry]) -> None:
        """Copies the blocks' pages out of the engine into the host tier."""
        blobs = self.engine.read_pages([e.page for e in entries])
        for e, blob in zip(entries, blobs, strict=True):
            tiers.demote(e.key, e.parent, e.tokens, blob, scope=e.scope, extra=e.extra)
        if self.metrics is not None:
            self.metrics.kv_tier_demotions.inc(len(entries))

    def restore(self, chain: Sequence[BlockMeta], pages: Sequence[int]) -> list[bytes]:
        """Writes the lower tiers' blocks `chain` (in order, up to the first one no tier holds any
        more) into `pages` (held by the caller) and registers them; returns their keys."""
        blobs, tiers = [], []
        for meta in chain:
            found = self.tiers.lookup(meta.key)
            if found is None:
                break
            blobs.append(found[0])
            tiers.append(found[1])
        if not blobs:
            return []
        self.engine.write_pages(pages[: len(blobs)], blobs)
        keys = []
        for meta, page in zip(chain, pages, strict=False):
            if len(keys) == len(blobs):
                break
            key = self.pool.register_restored(meta.parent, meta.scope, meta.tokens, page, extra=meta.extra)
            keys.append(key)
        if self.metrics is not None:
            for tier in tiers:
                self.metrics.kv_tier_hits.labels(tier=tier).inc()
        return keys

    def register(
        self,
        parent: bytes,
        ids: np.ndarray,
        pages: Sequence[int],
        blocks: range,
        scope: str,
        images: Sequence[RequestImage],
    ) -> bytes:
        """Registers the full blocks `blocks` of the token ids `ids`, held in `pages`, each the child
        of the one before (the first of `parent`); returns the last one's key (`parent` if none)."""
        ps = self.page_size
        for i in blocks:
            parent = self.pool.register(
                parent,
                ids[i * ps : (i + 1) * ps],
                pages[i],
                scope=scope,
                extra=block_extra(images, i * ps, ps),
            )
        return parent

    def offload(self) -> int:
        """Demotes every block of the device cache to the tiers and empties the device cache; returns
        how many blocks moved (`Scheduler.offload_prefix_cache`)."""
        if self.tiers is None:
            raise ValueError("offload_prefix_cache: no KV tiers (kv_host_bytes / kv_disk_dir)")
        entries = self.pool.cached_entries()
        self._demote(self.tiers, entries)
        self.pool.clear_cache()
        return len(entries)

    def close(self) -> None:
        """Persists the tiers (`Scheduler.close_tiers`): with a disk tier every block of the device
        cache is demoted and the host blocks are written to disk; then the tiers are closed. Idempotent."""
        tiers, self.tiers = self.tiers, None
        if tiers is None:
            return
        try:
            if tiers.disk is not None:
                self._demote(tiers, self.pool.cached_entries())
                tiers.spill()
        finally:
            tiers.close()

    def export_gauges(self, m: Metrics) -> None:
        """The tiers' sizes as gauges, and what the disk tier and promotions did since the last call
        as counters and latencies."""
        if self.tiers is None:
            return
        for name, value in self.tiers.gauges().items():
            tier, what = name.split("_", 1)
            if what in ("pages", "bytes"):
                (m.kv_tier_pages if what == "pages" else m.kv_tier_bytes).labels(tier=tier).set(value)
            elif tier == "disk":  # the tier's running counts, exported as counters
                event = _DISK_EVENTS[what]
                delta = value - self._disk_events_seen.get(event, 0)
                if delta > 0:
                    m.kv_disk_events.labels(event=event).inc(delta)
                    self._disk_events_seen[event] = value
        stats = self.tiers.stats
        new = stats.promotions - self._promotions_seen
        self._promotions_seen = stats.promotions
        for seconds in list(stats.promotion_latency_s)[-new:] if new > 0 else ():
            m.kv_promotion_seconds.observe(seconds)


_DISK_EVENTS = {
    "corrupt_removed": "corrupt",
    "refused_removed": "refused",
    "stale_temp_removed": "stale_temp",
    "evictions": "evicted",
    "write_errors": "write_error",
}


def images_in(images: Sequence[RequestImage], start: int, end: int) -> list[RequestImage]:
    """The image spans that overlap the positions [start, end)."""
    return [im for im in images if im.start < end and im.end > start]


def block_extra(images: Sequence[RequestImage], start: int, size: int) -> bytes:
    """The prefix-cache key extra of the block [start, start + size): the content hash and place of
    every image span it overlaps (pages.block_key), b"" for a text block. (The hash fixes the
    span's length and types: they follow from the pre-processed image.)"""
    return b"".join(
        im.content_hash + np.int64(im.start - start).tobytes()
        for im in images_in(images, start, start + size)
    )
