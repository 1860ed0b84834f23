"""KV tiers wired into the scheduler (issue 13, points 3 and 4), against the mock engine: blocks the
device prefix cache evicts go to host memory and disk and come back on a hit, with the cold run's
tokens; a restart with the same disk directory finds them; another model's directory is refused."""

import os

import pytest
from serving_helpers import make_engine_and_config, request, run_until_idle

from serving.config import ServeConfig
from serving.engine.protocol import SamplingParams
from serving.metrics import Metrics
from serving.scheduling.scheduler import Scheduler
from serving.scheduling.streams import collect
from serving.testing.mock_engine import ByteTokenizer, MockRule

pytestmark = pytest.mark.timeout(60)

TOK = ByteTokenizer()
PS = 4
SAMPLING = SamplingParams(temperature=0.7, seed=3)
PROMPT = TOK.encode("a shared system prompt!!")  # 24 tokens: 5 reusable blocks (never the last one)
OTHER = TOK.encode("something else entirely, long enough to need the pages")[:40]


def _sched(metrics=None, **kw):
    kw = {"page_size": PS, "num_pages": 16, "max_context": 64, **kw}
    engine, cfg = make_engine_and_config(**kw)
    return engine, Scheduler(engine, TOK, cfg, metrics)


def _run(sched, rid, prompt, max_tokens=8):
    events = []
    sched.submit(request(rid, prompt, max_tokens=max_tokens, sampling=SAMPLING), events.append)
    run_until_idle(sched)
    return collect(events)


def _cold(prompt, max_tokens=8):
    _, sched = _sched(num_pages=64)
    return _run(sched, "cold", prompt, max_tokens)[0]


def _evict_then_hit(sched):
    """PROMPT, then OTHER (its 14 pages of 16 evict PROMPT's blocks), then PROMPT again."""
    _run(sched, "a", PROMPT)
    _run(sched, "other", OTHER, max_tokens=16)
    return _run(sched, "b", PROMPT)


def test_without_tiers_the_evicted_prefix_is_recomputed():
    engine, sched = _sched()
    ids, _, last = _evict_then_hit(sched)
    assert sched.pool.evictions > 0
    assert last.usage.cached_prompt_tokens < 20  # what the tiered runs below restore
    assert ids == _cold(PROMPT)


def test_host_tier_restores_evicted_blocks_with_the_cold_tokens():
    metrics = Metrics()
    engine, sched = _sched(metrics, kv_host_bytes=1 << 20)
    ids, _, last = _evict_then_hit(sched)
    assert sched.pool.evictions > 0 and engine.pages_read > 0
    assert last.usage.cached_prompt_tokens == 20
    restored = metrics.registry.get_sample_value("ced_kv_tier_hits_total", {"tier": "host"})
    assert restored >= 1 and engine.pages_written == restored
    assert ids == _cold(PROMPT)  # the restored pages are the computed ones
    # the prefill of the hit started after the restored blocks
    assert [(s, n) for _, s, n, _ in engine.prefill_log][-1] == (20, 4)
    assert metrics.registry.get_sample_value("ced_kv_tier_pages", {"tier": "host"}) > 0
    sched.pool.check_invariants()
    assert sched.pool.num_referenced == 0
    sched.close_tiers()


def test_disk_tier_hit_and_warm_restart(tmp_path):
    disk = str(tmp_path / "kv")
    metrics = Metrics()
    # 16 bytes a page: the host tier holds one page, the rest is pushed to disk
    engine, sched = _sched(metrics, kv_host_bytes=PS * 4, kv_disk_dir=disk, kv_disk_bytes=1 << 20)
    ids, _, last = _evict_then_hit(sched)
    sched.tiers.flush()
    assert last.usage.cached_prompt_tokens == 20 and ids == _cold(PROMPT)
    assert metrics.registry.get_sample_value("ced_kv_tier_hits_total", {"tier": "disk"}) >= 1
    assert metrics.registry.get_sample_value("ced_kv_tier_promotion_seconds_count") is not None
    sched.close_tiers()  # what shutdown does: the device cache and the host tier go to disk
    assert sched.tiers is None and any(f.endswith(".kvb") for f in os.listdir(disk))

    # A new process (new engine and scheduler) with the same directory: the prompt's blocks come
    # from disk, nothing before them is prefilled, and the tokens are the cold run's.
    engine2, sched2 = _sched(kv_host_bytes=PS * 4, kv_disk_dir=disk, kv_disk_bytes=1 << 20)
    ids2, _, last2 = _run(sched2, "again", PROMPT)
    assert last2.usage.cached_prompt_tokens == 20 and ids2 == ids
    assert [(s, n) for _, s, n, _ in engine2.prefill_log] == [(20, 4)]
    sched2.close_tiers()

    # Another model (a different rule: another fingerprint) refuses and deletes those files.
    metrics3 = Metrics()
    engine3, sched3 = _sched(
        metrics3, kv_host_bytes=PS * 4, kv_disk_dir=disk, kv_disk_bytes=1 << 20, rule=MockRule(window=2)
    )
    refused = sched3.tiers.disk.refused_removed
    assert refused > 0
    _, _, last3 = _run(sched3, "other-model", PROMPT)
    assert last3.usage.cached_prompt_tokens == 0
    # the disk tier's counts are metrics (issue 33.8)
    assert metrics3.registry.get_sample_value("ced_kv_disk_events_total", {"event": "refused"}) == refused
    sched3.close_tiers()


def test_a_second_server_on_the_same_disk_directory_is_refused(tmp_path):
    disk = str(tmp_path / "kv")
    _, sched = _sched(kv_host_bytes=64, kv_disk_dir=disk, kv_disk_bytes=1 << 20)
    try:
        with pytest.raises(RuntimeError, match="in use by another process"):
            _sched(kv_host_bytes=64, kv_disk_dir=disk, kv_disk_bytes=1 << 20)
    finally:
        sched.close_tiers()


@pytest.mark.parametrize(
    "bad, needle",
    [
        (dict(kv_host_bytes=-1), "kv_host_bytes"),
        (dict(kv_disk_dir="/tmp/x"), "kv_disk_bytes"),
        (dict(kv_disk_bytes=100), "kv_disk_dir"),
        (dict(kv_host_bytes=100, enable_prefix_cache=False), "prefix cache"),
    ],
)
def test_tier_config_errors_name_the_field(bad, needle):
    with pytest.raises(ValueError, match=needle):
        ServeConfig(max_slots=4, page_size=16, max_context=256, **bad)


def test_an_engine_that_cannot_copy_pages_refuses_tiers():
    import dataclasses

    engine, cfg = make_engine_and_config(kv_host_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_host_bytes"):
        cfg.check_engine(dataclasses.replace(engine.spec, kv_page_bytes=0))


def test_a_tier_hit_is_replayed_like_a_device_hit():
    """An engine with state outside the pages (the mock's ring, replay_tokens 8): a prefix restored
    from host memory is resumed 8 tokens early, as a device hit is, and gives the cold tokens."""
    engine, sched = _sched(kv_host_bytes=1 << 20, replay_tokens=8)
    ids, _, last = _evict_then_hit(sched)
    assert last.usage.cached_prompt_tokens == 20 and engine.pages_written > 0
    assert ids == _cold(PROMPT)
    assert [(s, n) for _, s, n, _ in engine.prefill_log][-1] == (12, 12)  # replays [12, 20), then 4 new
    sched.close_tiers()


def test_offload_prefix_cache_moves_every_block_to_host():
    engine, sched = _sched(kv_host_bytes=1 << 20)
    ids, _, _ = _run(sched, "a", PROMPT)
    blocks = len(sched.pool.cached_entries())
    assert blocks == 7 and sched.offload_prefix_cache() == blocks  # 24 prompt + 7 written output tokens
    assert sched.pool.cached_entries() == [] and sched.tiers.host.pages == blocks
    again, _, last = _run(sched, "b", PROMPT)
    assert last.usage.cached_prompt_tokens == 20 and again == ids
    sched.close_tiers()
    _, plain = _sched()
    with pytest.raises(ValueError, match="no KV tiers"):
        plain.offload_prefix_cache()
