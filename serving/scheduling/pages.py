"""Host-side KV page allocator with a prefix cache (numpy only; no JAX).

Every page is in exactly one of three states:
- free: on the free list, content meaningless;
- referenced: `refcount > 0`, held by one or more running requests (shared pages are full prompt
  blocks served from the prefix cache, read-only for everyone);
- cached: `refcount == 0` but registered in the prefix cache, kept in LRU order and evicted (back to
  free) when an allocation needs the space.
A referenced page may also be registered in the cache; when its last holder releases it, it becomes
cached (if registered) or free (if not). So `num_free + num_cached + num_referenced == num_pages`.

Prefix cache. Block `i` of a sequence is tokens `[i * page_size, (i + 1) * page_size)`, and only full
blocks are cached. A block is keyed by a hash chain, `key_i = H(key_{i-1} || tag || tokens_i)` (the
scope's tag, below) with a cryptographic hash (blake2b, 128 bits), so a key identifies the whole prefix,
not just one block, and crafted prompts cannot collide into other pages; the stored tokens are compared
on a match as well. An entry is its page and its tokens, nothing else: an engine whose state reaches
outside the pages rebuilds it on a hit by replaying cached tokens (`serving/engine/protocol.py`).

Scopes. `tag` is a scope's `scope_tag`, a 128-bit hash of its name (the scheduler passes the
request's identity, or "" for everybody when the cache is shared). The same tokens in two scopes
therefore have unrelated keys and never match, so a tenant cannot learn from a hit
(`cached_prompt_tokens`, a faster first token) whether another tenant sent a prefix. Each scope keeps
its own pages for equal blocks; scopes share only the pool and its LRU order.

Eviction removes the least recently released block. Its descendants become unreachable (lookups walk
the chain from the root), so they are dropped from the cache too: unreferenced ones go straight to the
free list, referenced ones are simply unregistered and are freed when released. Requests release their
pages last block first, so deeper blocks are older in LRU order and are evicted before their parents.

Lower tiers (`serving/scheduling/kv_tiers.py`). `on_evict(entry)`, if given, is called for every entry that
eviction removes (the LRU block and the descendants it cuts off), while `entry.page` still holds the
block's KV: before the page is handed out again, so the engine can copy the page's bytes down to host
memory or disk. `register_restored` puts a block whose page was just written back from such a tier
into the cache again, under the scope tag the tier kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

ROOT_KEY = b"\x00" * 16


class OutOfPages(RuntimeError):
    pass


def scope_tag(scope: str) -> bytes:
    """The fixed-length tag a scope name contributes to every block key of that scope."""
    return hashlib.blake2b(scope.encode("utf-8"), digest_size=16, person=b"ced-prefix-scope").digest()


def block_key(parent: bytes, tag: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> bytes:
    """The hash-chain key of a block of tokens following the prefix keyed `parent`, in scope `tag`.

    `parent` and `tag` are 16 bytes each and the tokens a fixed page of int32, so the hashed bytes
    split one way only. `extra` is what the ids do not say about the block: for a block overlapping
    an image span, the image's content hash and where the span lies (every span position holds the
    same placeholder id, so two images would otherwise share keys).
    """
    data = np.asarray(tokens, dtype=np.int32).tobytes()
    return hashlib.blake2b(parent + tag + data + extra, digest_size=16).digest()


@dataclasses.dataclass(eq=False)
class CacheEntry:
    key: bytes
    parent: bytes
    scope: bytes  # scope_tag of the requests that may match it
    page: int
    tokens: np.ndarray  # i32[page_size]
    extra: bytes = b""  # see block_key
    children: set[bytes] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The cached blocks a prompt starts with, in order (not yet referenced)."""

    entries: tuple[CacheEntry, ...]

    @property
    def pages(self) -> list[int]:
        return [e.page for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)


class PagePool:
    """Allocator over `num_pages` pages of `page_size` tokens, with reference counts and a prefix cache."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_cache: bool = True,
        on_evict: Callable[[CacheEntry], None] | None = None,
        blocks: int = 1,
    ):
        """blocks: the pool is `blocks` equal blocks of consecutive pages (data-parallel attention: one
        per device, `EngineSpec.kv_blocks`); `allocate` then names the block to take pages from, and
        evicts only that block's cached pages. The prefix cache spans the blocks (a hit may be on
        another device's block: `block_of` says where)."""
        if blocks < 1 or num_pages % blocks:
            raise ValueError(f"num_pages {num_pages} is not a multiple of blocks {blocks}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self._on_evict = on_evict
        self.blocks = blocks
        self.block_pages = num_pages // blocks
        self._refcount = np.zeros(num_pages, np.int32)
        # Per block, popped from the end; reversed so that pages are handed out in ascending order at first.
        self._free_by_block: list[list[int]] = [
            list(range((b + 1) * self.block_pages - 1, b * self.block_pages - 1, -1)) for b in range(blocks)
        ]
        self._entries: dict[bytes, CacheEntry] = {}
        self._page_entry: dict[int, CacheEntry] = {}  # page -> its cache entry, if registered
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached unreferenced pages, oldest first
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free_by_block)

    @property
    def _free(self) -> list[int]:
        """Every free page (read-only view for counts and checks)."""
        return [p for f in self._free_by_block for p in f]

    def block_of(self, page: int) -> int:
        return page // self.block_pages

    def num_available_in(self, block: int) -> int:
        """Pages an allocation from `block` can obtain now (its free pages plus its evictable ones)."""
        if self.blocks == 1:
            return self.num_available
        cached = sum(1 for p in self._lru if p // self.block_pages == block)
        return len(self._free_by_block[block]) + cached

    def _release_page(self, page: int) -> None:
        self._free_by_block[page // self.block_pages].append(page)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for the prefix cache (evictable)."""
        return len(self._lru)

    @property
    def num_referenced(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Pages an allocation can obtain now (free plus evictable)."""
        return self.num_free + self.num_cached

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int, block: int | None = None) -> list[int]:
        """n fresh pages with refcount 1, evicting least recently used cached pages if needed. With
        several blocks the pages come from `block` (required), evicting only its cached pages."""
        if block is None:
            if self.blocks > 1:
                raise ValueError(f"allocate: the pool has {self.blocks} blocks; name the block")
            block = 0
        if not 0 <= block < self.blocks:
            raise ValueError(f"allocate: block {block} outside 0..{self.blocks - 1}")
        available = self.num_available_in(block)
        if n > available:
            where = f" in block {block}" if self.blocks > 1 else ""
            raise OutOfPages(f"need {n} pages, {available} available{where}")
        free = self._free_by_block[block]
        out = []
        for _ in range(n):
            if not free:
                self._evict_one(block)
            page = free.pop()
            self._refcount[page] = 1
            out.append(page)
        return out

    def acquire(self, pages: Iterable[int]) -> None:
        """Adds a reference to pages already referenced or cached (a prefix hit)."""
        for page in pages:
            if self._refcount[page] == 0:
                if page not in self._lru:
                    raise ValueError(f"page {page} is free; only referenced or cached pages can be acquired")
                del self._lru[page]
            self._refcount[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference from each page; call with a sequence's pages in order.

        Pages are processed last first, so a sequence's deeper blocks become older in LRU order than
        its shallower ones and are evicted first.
        """
        for page in reversed(pages):
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than referenced")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._page_entry:
                    self._lru[page] = None
                else:
                    self._release_page(page)

    # ---- prefix cache -------------------------------------------------------------------------

    def match(
        self,
        token_ids: Sequence[int] | np.ndarray,
        max_blocks: int | None = None,
        *,
        scope: str = "",
        block_extras: Sequence[bytes] | None = None,
    ) -> PrefixMatch:
        """The longest chain of cached full blocks in `scope` that `token_ids` starts with.
        block_extras[i]: block i's `block_key` extra (image spans), b"" for a text block."""
        if not self.enable_prefix_cache:
            return PrefixMatch(())
        tokens = np.asarray(token_ids, dtype=np.int32)
        n = len(tokens) // self.page_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        out = []
        key = ROOT_KEY
        tag = scope_tag(scope)
        for i in range(n):
            block = tokens[i * self.page_size : (i + 1) * self.page_size]
            extra = block_extras[i] if block_extras is not None else b""
            key = block_key(key, tag, block, extra)
            entry = self._entries.get(key)
            if entry is None or not np.array_equal(entry.tokens, block) or entry.extra != extra:
                break
            out.append(entry)
        return PrefixMatch(tuple(out))

    def register(
        self,
        parent: bytes,
        tokens: np.ndarray,
        page: int,
        *,
        scope: str = "",
        extra: bytes = b"",
    ) -> bytes:
        """Registers a full, written block held by the caller in `scope`; returns its key (the next parent).

        If the key is already cached (another request computed the same prefix), the existing entry
        wins and `page` stays private to its holder.
        """
        return self._register(parent, scope_tag(scope), tokens, page, extra)

    def register_restored(
        self, parent: bytes, tag: bytes, tokens: np.ndarray, page: int, *, extra: bytes = b""
    ) -> bytes:
        """Registers a block whose page the caller holds (refcount > 0) and has just written back
        from a lower tier; `tag` is the block's scope tag (`CacheEntry.scope`, as the tier kept it).
        Returns its key. Same rules as `register`: an existing entry wins, a broken chain is not
        cached."""
        if len(tag) != 16:
            raise ValueError(f"tag: expected a 16-byte scope tag, got {len(tag)} bytes")
        return self._register(parent, tag, tokens, page, extra)

    def cached_entries(self) -> list[CacheEntry]:
        """Every block of the cache, parents before their children."""
        return list(self._entries.values())

    def entry(self, key: bytes) -> CacheEntry | None:
        """The cache entry of `key`, if the block is in the device cache."""
        return self._entries.get(key)

    def _register(self, parent: bytes, tag: bytes, tokens: np.ndarray, page: int, extra: bytes) -> bytes:
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) != self.page_size:
            raise ValueError("only full blocks can be registered")
        key = block_key(parent, tag, tokens, extra)
        if not self.enable_prefix_cache:
            return key
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} must be referenced by the caller to be registered")
        existing = self._entries.get(key)
        if existing is not None:
            return key
        if page in self._page_entry:
            raise ValueError(f"page {page} is already registered under another key")
        if parent != ROOT_KEY and parent not in self._entries:
            # The parent was evicted while this request ran: the chain is broken, so this block
            # could never be matched. Do not cache it.
            return key
        if parent != ROOT_KEY and self._entries[parent].scope != tag:
            raise ValueError("the parent block belongs to another scope")
        entry = CacheEntry(key=key, parent=parent, scope=tag, page=page, tokens=tokens.copy(), extra=extra)
        self._entries[key] = entry
        self._page_entry[page] = entry
        if parent != ROOT_KEY:
            self._entries[parent].children.add(key)
        return key

    def clear_cache(self) -> None:
        """Drops every cache entry (unreferenced cached pages become free)."""
        for key in [
            k for k, e in self._entries.items() if e.parent == ROOT_KEY or e.parent not in self._entries
        ]:
            if key in self._entries:
                self._drop_entry(self._entries[key])

    # ---- internals ----------------------------------------------------------------------------

    def _evict_one(self, block: int = 0) -> None:
        if self.blocks == 1:
            page = next(iter(self._lru))
        else:
            page = next(p for p in self._lru if p // self.block_pages == block)
        self.evictions += 1
        self._drop_entry(self._page_entry[page], evicted=True)

    def _drop_entry(self, entry: CacheEntry, *, evicted: bool = False) -> None:
        """Removes `entry` and all its descendants from the cache (`on_evict` first if `evicted`)."""
        stack = [entry]
        if entry.parent != ROOT_KEY and entry.parent in self._entries:
            self._entries[entry.parent].children.discard(entry.key)
        while stack:
            e = stack.pop()
            if evicted and self._on_evict is not None:
                self._on_evict(e)
            del self._entries[e.key]
            del self._page_entry[e.page]
            if self._refcount[e.page] == 0:
                del self._lru[e.page]
                self._release_page(e.page)
            stack.extend(self._entries[c] for c in e.children if c in self._entries)

    def check_invariants(self) -> None:
        """Raises AssertionError if the page states are inconsistent (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page on the free list"
        for b, pages in enumerate(self._free_by_block):
            assert all(p // self.block_pages == b for p in pages), f"block {b} lists another's page"
        lru = set(self._lru)
        assert not (free & lru), "page both free and cached"
        for page in range(self.num_pages):
            rc = int(self._refcount[page])
            assert rc >= 0, f"negative refcount on page {page}"
            if page in free:
                assert rc == 0, f"free page {page} has refcount {rc}"
                assert page not in self._page_entry, f"free page {page} is registered"
            elif page in lru:
                assert rc == 0, f"cached page {page} has refcount {rc}"
                assert page in self._page_entry, f"cached page {page} has no entry"
            else:
                assert rc > 0, f"page {page} leaked: not free, not cached, refcount 0"
        assert len(self._page_entry) == len(self._entries)
        for key, e in self._entries.items():
            assert self._page_entry[e.page] is e
            assert e.key == key == block_key(e.parent, e.scope, e.tokens, e.extra)
            assert e.parent == ROOT_KEY or e.parent in self._entries, "orphan entry"
            assert e.parent == ROOT_KEY or self._entries[e.parent].scope == e.scope, "chain crosses scopes"
            for c in e.children:
                assert c not in self._entries or self._entries[c].parent == key
