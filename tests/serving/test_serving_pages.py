"""serving/scheduling/pages.py: allocation, reference counts, prefix matching, LRU eviction, no leaks."""

import numpy as np
import pytest

from serving.scheduling.pages import ROOT_KEY, OutOfPages, PagePool, scope_tag

pytestmark = pytest.mark.timeout(60)

PS = 4


def _register_all(pool, tokens, pages, scope=""):
    key = ROOT_KEY
    for i in range(len(tokens) // PS):
        key = pool.register(key, tokens[i * PS : (i + 1) * PS], pages[i], scope=scope)
    return key


def test_allocate_release_counts():
    pool = PagePool(8, PS)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 5 and pool.num_referenced == 3
    with pytest.raises(OutOfPages):
        pool.allocate(6)
    pool.release(a)
    assert pool.num_free == 8 and pool.num_referenced == 0
    with pytest.raises(ValueError):
        pool.release([0])
    pool.check_invariants()


def test_shared_prefix_refcounts_and_cached_state():
    pool = PagePool(8, PS)
    tokens = np.arange(10)
    pages = pool.allocate(3)
    _register_all(pool, tokens, pages)  # two full blocks
    m = pool.match(np.arange(12))
    assert m.pages == pages[:2]
    pool.acquire(m.pages)
    assert pool.refcount(pages[0]) == 2
    pool.release(pages)  # first holder finishes
    assert pool.refcount(pages[0]) == 1 and pool.num_cached == 0 and pool.num_free == 6
    pool.release(m.pages)
    assert pool.num_cached == 2 and pool.num_free == 6 and pool.num_referenced == 0
    # a different second block only matches the first
    assert pool.match([0, 1, 2, 3, 9, 9, 9, 9]).pages == pages[:1]
    assert len(pool.match(np.arange(12), max_blocks=1)) == 1
    pool.check_invariants()


def test_lru_eviction_deepest_first_and_cascades():
    dropped = []  # the block index of every evicted entry
    pool = PagePool(6, PS, on_evict=lambda e: dropped.append(int(e.tokens[0]) // PS))
    a = pool.allocate(3)
    _register_all(pool, np.arange(12), a)
    pool.release(a)  # released last-block-first: a[2] is the oldest in LRU
    b = pool.allocate(3)  # uses the 3 free pages
    assert set(b).isdisjoint(a)
    pool.allocate(1)  # must evict: the deepest block goes first
    assert dropped == [2] and len(pool.match(np.arange(12))) == 2
    # evicting a parent drops its (unreachable) descendants too
    pool._evict_one()
    pool._evict_one()
    assert pool.num_cached == 0
    assert sorted(dropped) == [0, 1, 2]
    pool.check_invariants()


def test_collision_keeps_existing_entry_and_broken_chain_is_not_cached():
    pool = PagePool(8, PS)
    a = pool.allocate(1)
    b = pool.allocate(1)
    k = pool.register(ROOT_KEY, [1, 2, 3, 4], a[0])
    assert pool.register(ROOT_KEY, [1, 2, 3, 4], b[0]) == k
    assert pool.match([1, 2, 3, 4]).pages == a
    pool.release(b)
    assert pool.num_free == 7  # the private duplicate is freed, not cached
    c = pool.allocate(1)
    orphan = pool.register(b"\x01" * 16, [5, 6, 7, 8], c[0])  # unknown parent: cannot be matched
    assert pool.entry(orphan) is None
    pool.release(c)
    assert pool.num_free == 7 and pool.num_cached == 0
    pool.check_invariants()


def test_scopes_never_match_each_other():
    pool = PagePool(16, PS)
    tokens = np.arange(8)
    a = pool.allocate(2)
    _register_all(pool, tokens, a, scope="alice")
    assert pool.match(tokens, scope="alice").pages == a  # positive control: the owner hits
    assert len(pool.match(tokens, scope="bob")) == 0
    assert len(pool.match(tokens)) == 0  # the shared scope "" is a scope like any other
    # bob computes the same blocks: his own entries, alice's stay as they were
    b = pool.allocate(2)
    _register_all(pool, tokens, b, scope="bob")
    assert pool.match(tokens, scope="bob").pages == b
    assert pool.match(tokens, scope="alice").pages == a
    # a chain cannot continue under another scope's block
    c = pool.allocate(1)
    alice_first = pool.match(tokens[:PS], scope="alice").entries[0].key
    with pytest.raises(ValueError, match="another scope"):
        pool.register(alice_first, np.arange(8, 12), c[0], scope="bob")
    pool.release(c)
    pool.release(a)
    pool.release(b)
    pool.check_invariants()
    pool.clear_cache()
    assert pool.num_free == 16


def test_prefix_cache_disabled():
    pool = PagePool(4, PS, enable_prefix_cache=False)
    a = pool.allocate(2)
    _register_all(pool, np.arange(8), a)
    assert len(pool.match(np.arange(8))) == 0
    pool.release(a)
    assert pool.num_free == 4


def test_randomized_no_leaks_and_consistent_refcounts():
    """Random admit / finish / cancel / evict sequences, checking every invariant after each op."""
    rng = np.random.default_rng(0)
    pool = PagePool(24, PS)
    prefixes = [rng.integers(0, 5, size=12) for _ in range(3)]
    scopes = ["", "a", "b"]
    live: dict[int, list[int]] = {}  # request -> pages it holds (one reference each)
    hits = 0
    for step in range(3000):
        op = rng.choice(["admit", "finish", "cancel", "pressure"], p=[0.45, 0.25, 0.15, 0.15])
        if op == "admit":
            prompt = np.concatenate([prefixes[rng.integers(3)][: rng.integers(0, 13)], rng.integers(0, 5, 9)])
            scope = scopes[rng.integers(3)]
            total = -(-(len(prompt) + int(rng.integers(1, 6))) // PS)
            m = pool.match(prompt, max_blocks=(len(prompt) - 1) // PS, scope=scope)
            assert all(e.scope == scope_tag(scope) for e in m.entries)
            hits += len(m)
            pool.acquire(m.pages)
            if pool.num_available < total - len(m):
                pool.release(m.pages)
                continue
            pages = m.pages + pool.allocate(total - len(m))
            key = m.entries[-1].key if len(m) else ROOT_KEY
            for i in range(len(m), len(prompt) // PS):
                key = pool.register(key, prompt[i * PS : (i + 1) * PS], pages[i], scope=scope)
            live[step] = pages
        elif op in ("finish", "cancel") and live:
            rid = list(live)[rng.integers(len(live))]
            pool.release(live.pop(rid))
        elif op == "pressure":
            n = int(rng.integers(1, 6))
            if pool.num_available >= n:
                pool.release(pool.allocate(n))
        pool.check_invariants()
        expect = np.zeros(pool.num_pages, int)
        for pages in live.values():
            np.add.at(expect, pages, 1)
        np.testing.assert_array_equal(pool._refcount, expect)
    for pages in live.values():
        pool.release(pages)
    assert pool.num_referenced == 0 and pool.num_free + pool.num_cached == pool.num_pages
    assert pool.evictions > 0 and hits > 100
    pool.clear_cache()
    assert pool.num_free == pool.num_pages
    pool.check_invariants()


def test_on_evict_sees_every_evicted_block_before_its_page_is_reused():
    seen = []

    def on_evict(entry):
        # the page still belongs to the entry: not free, not handed out yet
        assert entry.page not in pool._free and pool._page_entry.get(entry.page) is entry
        seen.append((entry.key, entry.page, entry.tokens.tolist(), pool.refcount(entry.page)))

    pool = PagePool(6, PS, on_evict=on_evict)
    a = pool.allocate(3)
    keys = []
    key = ROOT_KEY
    for i in range(3):
        key = pool.register(key, np.arange(i * PS, (i + 1) * PS), a[i])
        keys.append(key)
    pool.release(a)  # LRU: a[2] oldest, then a[1], a[0]
    pool.allocate(3)  # the free pages: no eviction
    assert seen == []
    pool.allocate(1)  # evicts the deepest block
    assert seen == [(keys[2], a[2], list(range(8, 12)), 0)]
    # A held chain whose parent is evicted: the held descendant is reported too (its page keeps its
    # bytes while its holder runs), and is freed, not cached, on release.
    pool2 = PagePool(4, PS, on_evict=lambda e: seen2.append((e.key, pool2.refcount(e.page))))
    seen2 = []
    b = pool2.allocate(2)
    k0 = pool2.register(ROOT_KEY, np.arange(PS), b[0])
    k1 = pool2.register(k0, np.arange(PS, 2 * PS), b[1])
    pool2.release(b[:1])  # the first block alone becomes cached, the second stays held
    pool2.allocate(2)
    pool2.allocate(1)  # evicts b[0], cutting off b[1]
    assert seen2 == [(k0, 0), (k1, 1)]
    assert len(pool2.match(np.arange(2 * PS))) == 0
    pool2.release(b[1:])
    assert pool2.num_cached == 0
    pool2.check_invariants()
    # clear_cache and the disabled cache drop without reporting evictions
    pool3 = PagePool(4, PS, on_evict=lambda e: pytest.fail("clear_cache is not an eviction"))
    c = pool3.allocate(1)
    pool3.register(ROOT_KEY, np.arange(PS), c[0])
    pool3.release(c)
    pool3.clear_cache()
    pool3.check_invariants()


def test_register_restored_makes_a_lower_tier_block_matchable_in_its_scope():
    pool = PagePool(8, PS)
    tokens = np.arange(3 * PS)
    a = pool.allocate(2)
    _register_all(pool, tokens[: 2 * PS], a, scope="alice")
    tag = scope_tag("alice")
    parent = pool.match(tokens, scope="alice").entries[-1].key
    # the third block comes back from a tier: the caller allocates a page, writes it, registers it
    p = pool.allocate(1)
    key = pool.register_restored(parent, tag, tokens[2 * PS :], p[0])
    assert pool.entry(key) is not None
    assert pool.match(tokens, scope="alice").pages == a + p
    assert len(pool.match(tokens, scope="bob")) == 0
    # the key is the one `register` would have produced for the same block
    q = pool.allocate(1)
    assert pool.register(parent, tokens[2 * PS :], q[0], scope="alice") == key
    pool.release(q)
    assert pool.num_free == 8 - 3  # q was a duplicate: freed, not cached
    # a broken chain is not cached; bad input names the field
    r = pool.allocate(1)
    orphan = pool.register_restored(b"\x05" * 16, tag, tokens[:PS], r[0])
    assert pool.entry(orphan) is None
    with pytest.raises(ValueError, match="tag"):
        pool.register_restored(ROOT_KEY, b"short", tokens[:PS], r[0])
    with pytest.raises(ValueError, match="referenced"):
        pool.register_restored(ROOT_KEY, tag, np.arange(100, 100 + PS), pool._free[-1])
    pool.release(r)
    pool.release(a + p)
    pool.check_invariants()
