"""serving/scheduling/prefix.py on its own, over the mock engine's pages: registered blocks are matched
(never the block of the last prompt token), image spans key the blocks they overlap, demoted blocks
continue the device match in the tiers and come back bit for bit."""

import numpy as np
from serving_helpers import make_engine_and_config

from serving.metrics import Metrics
from serving.scheduling.pages import ROOT_KEY
from serving.scheduling.prefix import TieredPrefixCache, block_extra, images_in
from serving.vision import RequestImage

PS = 4
PROMPT = np.arange(1, 15, dtype=np.int32)  # 14 tokens: blocks 0..2 are full, block 3 holds the last


def _cache(**kw):
    engine, cfg = make_engine_and_config(page_size=PS, num_pages=16, **kw)
    metrics = Metrics()
    return engine, TieredPrefixCache(engine, cfg, metrics), metrics


def _register_prompt(cache, scope=""):
    pages = cache.pool.allocate(3)
    key = cache.register(ROOT_KEY, PROMPT, pages, range(3), scope, ())
    return pages, key


def test_registered_blocks_match_in_their_scope_up_to_the_last_full_block():
    _, cache, _ = _cache()
    pages, key = _register_prompt(cache, scope="alice")
    entries = cache.device_match(PROMPT, (), "alice")
    assert [e.page for e in entries] == pages and entries[-1].key == key
    assert cache.device_match(PROMPT[:12], (), "alice") == entries[:2]  # block 2 holds the last token
    assert cache.device_match(PROMPT, (), "bob") == []
    assert cache.match(PROMPT, (), "alice") == (entries, [])  # no tiers: nothing below the device


def test_offloaded_blocks_continue_the_match_and_restore_bit_identical():
    engine, cache, metrics = _cache(kv_host_bytes=1 << 20)
    pages, key = _register_prompt(cache)
    engine.kv[pages] = np.arange(len(pages) * PS, dtype=np.int32).reshape(len(pages), PS) + 100
    before = engine.kv[pages].copy()
    cache.pool.release(pages)
    assert cache.offload() == 3 and cache.pool.num_cached == 0
    entries, chain = cache.match(PROMPT, (), "")
    assert entries == [] and len(chain) == 3
    fresh = cache.pool.allocate(3)
    engine.kv[fresh] = 0
    keys = cache.restore(chain, fresh)
    assert keys[-1] == key and (engine.kv[fresh] == before).all()
    assert [e.page for e in cache.device_match(PROMPT, (), "")] == fresh  # registered again
    assert metrics.registry.get_sample_value("ced_kv_tier_hits_total", {"tier": "host"}) == 3
    cache.export_gauges(metrics)
    assert metrics.registry.get_sample_value("ced_kv_tier_pages", {"tier": "host"}) == 3
    cache.close()
    assert cache.tiers is None


def test_an_image_span_keys_only_the_blocks_it_overlaps():
    im = RequestImage(5, np.array([0, 1, 3], np.int32), np.zeros((3, 2), np.float32), b"h" * 32)  # [5, 8)
    assert images_in([im], 0, 5) == [] and images_in([im], 7, 9) == [im]
    assert block_extra([im], 0, PS) == b""
    assert block_extra([im], 4, PS) == b"h" * 32 + np.int64(1).tobytes()
    assert block_extra([im], 8, PS) == b""
