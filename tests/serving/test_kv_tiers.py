"""serving/scheduling/kv_tiers.py: LRU and budgets of the host and disk tiers, atomic and checksummed disk
blocks (corruption, killed writers, foreign fingerprints), warm restart, promotion and prefetch."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from serving.scheduling.kv_tiers import MARKER_NAME, MARKER_TEXT, DiskTier, HostTier, TieredKV, make_meta
from serving.scheduling.pages import ROOT_KEY, PagePool, block_key, scope_tag
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

PS = 4  # tokens per block
B = 100  # payload bytes per block
TAG = scope_tag("")
FP = bytes(range(16))
# A file is its header (magic 8, digest 32, version 4, fingerprint/key/parent/scope 4 x 16, three
# lengths 4 + 4 + 8, the tokens) and the payload: written out from the format in the module docstring.
FILE = 8 + 32 + 4 + 64 + 16 + 4 * PS + B


def _chain(n: int, *, seed: int = 0, tag: bytes = TAG, size: int = B):
    """n chained blocks: (meta, payload) with payload random bytes."""
    rng = np.random.default_rng(seed)
    out, parent = [], ROOT_KEY
    for _ in range(n):
        tokens = rng.integers(0, 1000, PS).astype(np.int32)
        key = block_key(parent, tag, tokens)
        out.append((make_meta(key, parent, tokens, tag), rng.integers(0, 256, size, np.uint8).tobytes()))
        parent = key
    return out


def _files(d, suffix):
    return sorted(n for n in os.listdir(d) if n.endswith(suffix))


def test_host_tier_lru_and_budget():
    (a, pa), (b, pb), (c, pc), (d, pd) = _chain(4)
    host = HostTier(3 * B)
    assert host.put(a, pa) == [] and host.put(b, pb) == [] and host.put(c, pc) == []
    assert host.get(a.key) == pa  # a becomes the most recent: b is now the oldest
    pushed = host.put(d, pd)
    assert [(m.key, blob) for m, blob in pushed] == [(b.key, pb)]
    assert host.keys() == [c.key, a.key, d.key] and host.bytes == 3 * B and host.pages == 3
    big = _chain(1, seed=1, size=3 * B + 1)[0]
    assert host.put(*big) == [big] and big[0].key not in host  # larger than the budget: refused
    assert host.get(b.key) is None


def test_disk_tier_lru_budget_and_identical_bytes(tmp_path):
    blocks = _chain(4)
    disk = DiskTier(tmp_path, 3 * FILE, FP)
    for meta, payload in blocks[:3]:
        assert disk.put(meta, payload)
    assert [os.path.getsize(disk.path(m.key)) for m, _ in blocks[:3]] == [FILE] * 3
    assert disk.get(blocks[0][0].key) == blocks[0][1]  # identical bytes; now the most recent
    assert disk.put(*blocks[3])  # evicts the oldest: block 1
    a, b, c, d = (m.key for m, _ in blocks)
    assert disk.keys() == [c, a, d] and disk.bytes == 3 * FILE and disk.evictions == 1
    assert not os.path.exists(disk.path(b)) and disk.get(b) is None
    assert _files(tmp_path, ".kvb") == sorted(k.hex() + ".kvb" for k in (a, c, d))
    for meta, payload in (blocks[0], blocks[2], blocks[3]):
        assert disk.get(meta.key) == payload
    assert not disk.put(*_chain(1, seed=2, size=3 * FILE)[0])  # larger than the whole budget
    disk.close()


def test_corrupt_or_truncated_files_are_rejected_and_removed(tmp_path):
    blocks = _chain(5)
    disk = DiskTier(tmp_path, 10 * FILE, FP)
    for meta, payload in blocks:
        disk.put(meta, payload)
    keys = [m.key for m, _ in blocks]

    def damage(key, fn):
        data = bytearray(open(disk.path(key), "rb").read())
        data = fn(data)
        with open(disk.path(key), "wb") as f:
            f.write(data)

    def flip(pos):
        def fn(data):
            data[pos] ^= 0x01
            return data

        return fn

    damage(keys[0], flip(-1))  # last payload byte
    damage(keys[1], flip(FILE - B - 1))  # a token in the header
    damage(keys[2], lambda data: data[: FILE - 7])  # truncated payload
    for k in keys[:3]:
        assert disk.get(k) is None and not os.path.exists(disk.path(k)) and k not in disk
    assert disk.corrupt_removed == 3
    assert disk.get(keys[3]) == blocks[3][1]  # the untouched ones still read
    disk.close()
    # at start-up: a truncated file (size check) and a renamed one (name is not its key) go
    damage(keys[3], lambda data: data[:50])
    os.rename(disk.path(keys[4]), os.path.join(tmp_path, keys[0].hex() + ".kvb"))
    again = DiskTier(tmp_path, 10 * FILE, FP)
    assert again.pages == 0 and again.corrupt_removed == 2 and _files(tmp_path, ".kvb") == []
    again.close()


_WRITER = """
import os, sys
import numpy as np
import serving.scheduling.kv_tiers as kt
from serving.scheduling.pages import ROOT_KEY, block_key, scope_tag
directory, mode = sys.argv[1], sys.argv[2]
tag = scope_tag("")
disk = kt.DiskTier(directory, 1 << 30, bytes(range(16)))

def block(i, size):
    tokens = np.arange(4 * i, 4 * i + 4, dtype=np.int32)
    meta = kt.make_meta(block_key(ROOT_KEY, tag, tokens), ROOT_KEY, tokens, tag)
    return meta, np.random.default_rng(i).integers(0, 256, size, np.uint8).tobytes()

assert disk.put(*block(0, 100))
if mode == "half":
    def half_then_die(path, parts):
        data = b"".join(parts)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data[: len(data) // 2])
        os._exit(9)
    kt._write_temp = half_then_die
    disk.put(*block(1, 100))
else:
    i = 1
    while True:
        disk.put(*block(i, 1 << 18))
        print(i, flush=True)
        i += 1
"""


def _writer(tmp_path, mode):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", _WRITER, str(tmp_path), mode]
    return subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)


def _block_payload(i, size):
    return np.random.default_rng(i).integers(0, 256, size, np.uint8).tobytes()


def test_writer_killed_mid_write_leaves_no_entry(tmp_path):
    proc = _writer(tmp_path, "half")
    assert proc.wait(timeout=30) == 9
    assert len(_files(tmp_path, ".tmp")) == 1 and len(_files(tmp_path, ".kvb")) == 1  # half a temp file
    disk = DiskTier(tmp_path, 1 << 30, FP)  # the dead writer's lock is gone with it
    assert disk.stale_temp_removed == 1 and _files(tmp_path, ".tmp") == []
    assert disk.pages == 1
    (key,) = disk.keys()
    assert disk.get(key) == _block_payload(0, 100)
    disk.close()


def test_writer_sigkilled_while_writing_leaves_only_whole_entries(tmp_path):
    proc = _writer(tmp_path, "loop")
    for _ in range(4):  # a few blocks of 256 KiB written, then killed at an arbitrary point
        assert proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    disk = DiskTier(tmp_path, 1 << 30, FP)
    assert _files(tmp_path, ".tmp") == [] and disk.pages >= 5
    by_key = {}
    for i in range(disk.pages + 2):
        tokens = np.arange(4 * i, 4 * i + 4, dtype=np.int32)
        by_key[block_key(ROOT_KEY, TAG, tokens)] = _block_payload(i, 100 if i == 0 else 1 << 18)
    for key in disk.keys():
        assert disk.get(key) == by_key[key]
    assert disk.corrupt_removed == 0
    disk.close()


def test_other_fingerprint_is_refused_and_deleted_and_the_directory_is_exclusive(tmp_path):
    disk = DiskTier(tmp_path, 10 * FILE, FP)
    for meta, payload in _chain(3):
        disk.put(meta, payload)
    with pytest.raises(RuntimeError, match="in use"):
        DiskTier(tmp_path, 10 * FILE, FP)
    disk.close()
    other = DiskTier(tmp_path, 10 * FILE, bytes(16))
    assert other.pages == 0 and other.refused_removed == 3 and _files(tmp_path, ".kvb") == []
    other.close()
    with pytest.raises(ValueError, match="model_fingerprint"):
        DiskTier(tmp_path, FILE, b"short")


def test_a_non_empty_directory_without_the_marker_is_refused_untouched(tmp_path):
    (tmp_path / "notes.tmp").write_text("notes\n")
    (tmp_path / "report.kvb").write_text("x\n")
    for attempt in (lambda: DiskTier(tmp_path, 10 * FILE, FP), lambda: DiskTier.check_directory(tmp_path)):
        with pytest.raises(RuntimeError, match="not a KV disk tier"):
            attempt()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "report.kvb"]
    assert (tmp_path / "report.kvb").read_text() == "x\n"


def test_only_the_tiers_own_names_are_deleted_and_removals_are_logged(tmp_path, caplog):
    fresh = tmp_path / "kv"
    DiskTier.check_directory(fresh)  # the early check of a new directory marks it as the tier's
    assert (fresh / MARKER_NAME).read_text() == MARKER_TEXT
    disk = DiskTier(fresh, 10 * FILE, FP)
    for meta, payload in _chain(3):
        disk.put(meta, payload)
    disk.close()
    strays = {"notes.tmp": "notes", "report.kvb": "x", "ab.kvb": "y", "readme.txt": "hello"}
    for name, text in strays.items():
        (fresh / name).write_text(text)
    (fresh / f"{'0' * 32}.123.4.tmp").write_bytes(b"half a block")  # a writer that died mid-write
    with caplog.at_level(logging.INFO, logger="serving.scheduling.kv_tiers"):
        other = DiskTier(fresh, 10 * FILE, bytes(16))  # another model: its blocks go
    assert other.refused_removed == 3 and other.stale_temp_removed == 1 and other.pages == 0
    for name, text in strays.items():
        assert (fresh / name).read_text() == text
    assert sorted(p.name for p in fresh.iterdir()) == sorted([*strays, MARKER_NAME, "LOCK"])
    (record,) = [r for r in caplog.records if "removed" in r.getMessage()]
    message = record.getMessage()
    assert "3 block(s) of another model or format" in message and "1 temporary" in message
    other.close()


def test_warm_restart_keeps_entries_and_lru_order(tmp_path):
    blocks = _chain(5)
    a, b, c, d, e = (m.key for m, _ in blocks)
    disk = DiskTier(tmp_path, 4 * FILE, FP)
    for meta, payload in blocks[:4]:
        disk.put(meta, payload)
    disk.get(a)
    disk.get(b)
    assert disk.keys() == [c, d, a, b]
    disk.close()
    again = DiskTier(tmp_path, 4 * FILE, FP)
    assert again.keys() == [c, d, a, b] and again.bytes == 4 * FILE
    assert again.meta(a).parent == ROOT_KEY and again.meta(b).parent == a  # the chain is rebuilt
    np.testing.assert_array_equal(again.meta(c).tokens, blocks[2][0].tokens)
    assert again.get(c) == blocks[2][1]
    again.put(*blocks[4])  # the oldest now is d
    assert again.keys() == [a, b, c, e]
    again.close()
    smaller = DiskTier(tmp_path, 2 * FILE, FP)  # a smaller budget evicts the oldest at start-up
    assert smaller.keys() == [c, e]
    smaller.close()


def test_tiers_demote_push_down_promote_and_count(tmp_path):
    blocks = _chain(6)
    keys = [m.key for m, _ in blocks]
    payload = {m.key: p for m, p in blocks}
    tiers = TieredKV(HostTier(2 * B), DiskTier(tmp_path, 3 * FILE, FP), writer_threads=1)  # exact order
    for m, p in blocks[:3]:
        tiers.demote(m.key, m.parent, m.tokens, p)
    tiers.flush()
    assert tiers.host.keys() == keys[1:3] and tiers.disk.keys() == keys[:1]
    assert tiers.lookup(keys[0]) == (payload[keys[0]], "disk")  # promoted: host pushes keys[1] down
    assert tiers.lookup(keys[2]) == (payload[keys[2]], "host")
    tiers.flush()
    assert tiers.host.keys() == [keys[0], keys[2]]
    assert tiers.disk.keys() == keys[:2]  # inclusive: keys[0] kept its file
    assert tiers.lookup(b"\x07" * 16) is None
    s = tiers.stats
    assert (s.demotions, s.host_to_disk, s.hits_host, s.hits_disk, s.misses, s.promotions) == (
        3,
        2,
        1,
        1,
        1,
        1,
    )
    assert len(s.promotion_latency_s) == 1 and s.promotion_latency_s[0] > 0
    # Disk pressure evicts its LRU. Pushing keys[0] down again writes nothing (its file is only
    # touched: disk [1, 0]); keys[2] and keys[3] are written, and the second one evicts keys[1].
    for m, p in blocks[3:]:
        tiers.demote(m.key, m.parent, m.tokens, p)
    tiers.flush()
    assert tiers.host.keys() == keys[4:6] and tiers.disk.keys() == [keys[0], keys[2], keys[3]]
    g = tiers.gauges()
    assert (g["host_pages"], g["host_bytes"], g["disk_pages"], g["disk_bytes"]) == (2, 2 * B, 3, 3 * FILE)
    assert g["disk_evictions"] == 1 and g["pending_pages"] == 0
    for k in keys:  # every block that is still stored comes back with its own bytes
        hit = tiers.lookup(k)
        assert hit is None or hit[0] == payload[k]
    with pytest.raises(ValueError, match="key"):
        m, p = blocks[0]
        tiers.demote(keys[1], m.parent, m.tokens, p)
    tiers.close()
    # without a disk, host pressure drops
    host_only = TieredKV(HostTier(B))
    for m, p in blocks[:3]:
        host_only.demote(m.key, m.parent, m.tokens, p)
    assert host_only.stats.dropped == 2 and host_only.lookup(keys[0]) is None
    assert host_only.lookup(keys[2]) == (payload[keys[2]], "host")
    host_only.close()


def test_blocks_waiting_for_their_disk_write_stay_readable(tmp_path):
    (a, pa), (b, pb) = _chain(2)
    tiers = TieredKV(HostTier(B), DiskTier(tmp_path, 10 * FILE, FP), writer_threads=1, max_pending_bytes=B)
    gate = threading.Event()
    tiers._submit(tiers._writer, gate.wait)  # hold the writer thread
    tiers.demote(a.key, a.parent, a.tokens, pa)
    tiers.demote(b.key, b.parent, b.tokens, pb)  # pushes a down: queued behind the gate
    assert tiers.gauges()["pending_pages"] == 1 and not os.path.exists(tiers.disk.path(a.key))
    assert tiers.contains(a.key) and tiers.lookup(a.key) == (pa, "host")  # pushes b down: no room
    assert tiers.stats.backlog_drops == 1 and not tiers.contains(b.key)
    assert tiers.gauges()["pending_bytes"] == B
    gate.set()
    tiers.flush()
    assert tiers.disk.keys() == [a.key] and tiers.gauges()["pending_pages"] == 0
    assert tiers.gauges()["pending_bytes"] == 0 and tiers.host.keys() == [a.key]
    tiers.close()


def test_prefetch_moves_disk_blocks_to_host(tmp_path):
    blocks = _chain(6)
    keys = [m.key for m, _ in blocks]
    tiers = TieredKV(HostTier(3 * B), DiskTier(tmp_path, 10 * FILE, FP), writer_threads=1)
    for m, p in blocks:
        tiers.demote(m.key, m.parent, m.tokens, p)
    tiers.flush()
    assert tiers.host.keys() == keys[3:] and tiers.disk.keys() == keys[:3]
    future = tiers.prefetch([keys[0], keys[1], keys[4], b"\x09" * 16])  # host and unknown keys skipped
    assert future.result(timeout=10) == 2
    tiers.flush()
    assert tiers.host.keys() == [keys[5], keys[0], keys[1]]
    assert tiers.stats.prefetched == 2 and len(tiers.stats.promotion_latency_s) == 2
    assert tiers.lookup(keys[0]) == (blocks[0][1], "host") and tiers.stats.hits_disk == 0
    tiers.close()


def test_chain_and_page_pool_round_trip(tmp_path):
    """The intended call sequence (module docstring) on host arrays standing in for device pages:
    blocks the pool evicts go down with their bytes, then come back, chained, into fresh pages."""
    pages = np.zeros((4, B), np.uint8)  # the "device" page buffer
    evicted = []
    pool = PagePool(4, PS, on_evict=evicted.append)
    tiers = TieredKV(HostTier(2 * B), DiskTier(tmp_path, 10 * FILE, FP))
    prompt = np.arange(3 * PS + 1)
    rng = np.random.default_rng(3)
    held = pool.allocate(3)
    key = ROOT_KEY
    for i, p in enumerate(held):
        pages[p] = rng.integers(0, 256, B)
        key = pool.register(key, prompt[i * PS : (i + 1) * PS], p, scope="alice")
    written = pages[held].copy()
    pool.release(held)
    other = pool.allocate(4)  # evicts all three cached blocks (deepest first)
    assert len(evicted) == 3
    for e in evicted:  # before the pages are overwritten
        tiers.demote(e.key, e.parent, e.tokens, pages[e.page].tobytes(), scope=e.scope, extra=e.extra)
    pages[other] = 0
    pool.release(other)
    assert len(pool.match(prompt, scope="alice")) == 0
    tiers.flush()
    assert tiers.gauges()["disk_pages"] == 1  # one pushed to disk by the host budget
    # admission: nothing on device, three blocks in the tiers; another scope finds none
    tag = scope_tag("alice")
    assert tiers.chain(ROOT_KEY, scope_tag("bob"), prompt, PS) == []
    found = tiers.chain(ROOT_KEY, tag, prompt, PS, max_blocks=(len(prompt) - 1) // PS)
    assert len(found) == 3 and {m.key for m in found} == {e.key for e in evicted}
    tiers.prefetch([m.key for m in found]).result(timeout=10)
    fresh = pool.allocate(3)
    for meta, p in zip(found, fresh, strict=True):
        blob, _ = tiers.lookup(meta.key)
        pages[p] = np.frombuffer(blob, np.uint8)
        pool.register_restored(meta.parent, meta.scope, meta.tokens, p, extra=meta.extra)
    match = pool.match(prompt, scope="alice")
    assert match.pages == fresh
    np.testing.assert_array_equal(pages[fresh], written)
    # a block whose tokens differ ends the chain
    changed = prompt.copy()
    changed[PS + 1] += 1
    assert len(tiers.chain(ROOT_KEY, tag, changed, PS)) == 1
    pool.release(fresh)
    pool.check_invariants()
    tiers.close()


def test_concurrent_demote_lookup_prefetch_keep_bytes_and_budgets(tmp_path):
    """Random demotions, lookups and prefetches from three threads: every hit has its own bytes,
    both budgets hold, and the disk index matches the files."""
    blocks = _chain(40, seed=5)
    payload = {m.key: p for m, p in blocks}
    tiers = TieredKV(HostTier(6 * B), DiskTier(tmp_path, 15 * FILE, FP))
    errors = []

    def run(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                m, p = blocks[rng.integers(len(blocks))]
                op = rng.integers(3)
                if op == 0:
                    tiers.demote(m.key, m.parent, m.tokens, p)
                elif op == 1:
                    hit = tiers.lookup(m.key)
                    assert hit is None or hit[0] == payload[m.key]
                else:
                    tiers.prefetch([blocks[i][0].key for i in rng.integers(len(blocks), size=3)])
                assert tiers.host.bytes <= 6 * B
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    tiers.flush()
    assert errors == []
    assert tiers.disk.bytes <= 15 * FILE
    files = _files(tmp_path, ".kvb")
    assert files == sorted(k.hex() + ".kvb" for k in tiers.disk.keys())
    assert tiers.disk.bytes == sum(os.path.getsize(os.path.join(tmp_path, f)) for f in files)
    assert tiers.stats.demotions > 0 and tiers.stats.hits_host + tiers.stats.hits_disk > 0
    for k in tiers.disk.keys():
        assert tiers.disk.get(k) == payload[k]
    tiers.close()


def test_tiny_pages_device_to_disk_to_device_bit_identical(tmp_path):
    """The real page layout end to end: pages of the tiny preset's state, packed, demoted through
    host to disk, read back after a restart and written into other pages, bit for bit."""
    import jax
    import jax.numpy as jnp

    from ced_jax.cache import init_paged_cache
    from ced_jax.config import preset
    from ced_jax.engine.page_io import PageLayout, read_pages, write_pages

    cfg, page = preset("tiny"), 16
    layout = PageLayout.for_config(cfg, page)
    rng = np.random.default_rng(0)
    state = init_paged_cache(cfg, max_slots=1, page_size=page, num_pages=6)
    state = jax.tree.map(lambda a: jnp.asarray(rng.integers(0, 256, a.shape, np.uint8)), state)
    layout.check_state(state)
    blocks = _chain(3, seed=9)  # the chain only names the blocks here; the payload is the page
    src = np.array([4, 0, 2], np.int32)
    blobs = layout.pack(read_pages(state, src))
    fp = layout.fingerprint(b"tiny random weights")
    tiers = TieredKV(HostTier(layout.page_bytes), DiskTier(tmp_path, 10 * (layout.page_bytes + 1024), fp))
    for (m, _), blob in zip(blocks, blobs, strict=True):
        tiers.demote(m.key, m.parent, m.tokens, blob)
    tiers.close()
    # what reaches disk is the page plus its header (the tokens of the block included)
    sizes = {os.path.getsize(os.path.join(tmp_path, f)) for f in _files(tmp_path, ".kvb")}
    assert sizes == {layout.page_bytes + FILE - B}
    tiers = TieredKV(HostTier(layout.page_bytes), DiskTier(tmp_path, 10 * (layout.page_bytes + 1024), fp))
    assert set(tiers.disk.keys()) == {m.key for m, _ in blocks[:2]}  # the host's block was not kept
    tiers.demote(blocks[2][0].key, blocks[2][0].parent, blocks[2][0].tokens, blobs[2])
    tiers.spill()  # now it is
    tiers.close()
    tiers = TieredKV(HostTier(layout.page_bytes), DiskTier(tmp_path, 10 * (layout.page_bytes + 1024), fp))
    got = [tiers.lookup(m.key) for m, _ in blocks]
    assert [tier for _, tier in got] == ["disk"] * 3
    dst = np.array([1, 3, 5], np.int32)
    out = write_pages(state, dst, layout.unpack([blob for blob, _ in got]))
    for kind in ("kv", "index_k"):
        for s, buf in getattr(out, kind).items():
            want = np.asarray(getattr(state, kind)[s])[src]
            np.testing.assert_array_equal(np.asarray(buf)[dst], want)
    tiers.close()
