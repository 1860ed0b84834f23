"""Host-memory and disk tiers below the device KV pages (issue 13, points 3 and 4).

A page that the prefix cache (`serving/scheduling/pages.py`) evicts from the device is not dropped: its bytes
(one blob per page, `ced_jax.engine.page_io.PageLayout`: exactly the device bytes, 890 B/token for
v41-flash) are demoted to host memory and, under host pressure, to disk; a later request whose prompt
continues the device-cached chain into those blocks gets them back without recomputing them. Blocks
are keyed by the prefix cache's own hash-chain key (`pages.block_key`), and every stored block keeps
what rebuilds its chain link: parent key, scope tag, tokens and `extra`.

- `HostTier(max_bytes)`: an in-memory LRU of blobs (budget: blob bytes).
- `DiskTier(directory, max_bytes, model_fingerprint)`: one file per block, LRU within `max_bytes`
  (budget: file bytes, header included). Writes are atomic (temp file in the same directory, fsync,
  rename, fsync of the directory), so a crash leaves either the whole file or none; a leftover temp
  file is deleted at the next start-up. Each file carries a header with a checksum over everything
  but the magic (format below); a file that fails it (truncated, flipped bits) is deleted and reported
  as a miss, never returned. Start-up scans the directory (warm restart): files of another format
  version or model fingerprint (`PageLayout.fingerprint`) are deleted, the rest form the index in
  their last-use order (file mtimes, which the tier sets from a strictly increasing clock). An
  exclusive `flock` on `LOCK` keeps a second process off the directory. The directory is the tier's
  own: it is marked by `MARKER_NAME` when the tier starts in an empty (or new) directory, a non-empty
  directory without the marker is refused (it holds someone else's files), and only names of the
  tier's own patterns (`<key hex>.kvb`, `<key hex>.<pid>.<n>.tmp`) are ever deleted.
- `TieredKV(host, disk)`: `demote` puts a block on host; host pressure pushes its LRU blocks to disk
  (written on a background thread; until written they stay readable); disk pressure evicts. The disk
  is inclusive: a block promoted back to host keeps its file, so demoting it again costs no write.
  `lookup` promotes a disk hit to host; `prefetch` promotes on the background thread ahead of need.

File format (little-endian): magic `CEDKVBLK` | blake2b-256 of the rest | version u32 |
fingerprint 16 | key 16 | parent 16 | scope tag 16 | n_tokens u32 | extra_len u32 | payload_len u64 |
tokens i32[n_tokens] | extra | payload. The key must equal `block_key(parent, scope, tokens, extra)`
and the file's name (`<key hex>.kvb`).

How the server uses it (`serving/scheduling/scheduler.py`, module docstring "KV tiers", through
`serving/scheduling/prefix.py`; the engine side is `Engine.read_pages` / `write_pages`,
`EngineSpec.kv_page_bytes` and `Engine.kv_fingerprint()`):
1. Start-up: `TieredKV(HostTier(kv_host_bytes), DiskTier(kv_disk_dir, kv_disk_bytes, fingerprint))`,
   the fingerprint from `PageLayout.fingerprint(weights_id)` (weights_id names the checkpoint: tiny
   and tiny-draft share a config).
2. Demotion: `PagePool(..., on_evict=...)` collects the evicted entries inside `pool.allocate`; right
   after it returns, before any engine call writes the pages it handed out, their pages are read out
   and `demote`d.
3. Enqueue: the device match, then `chain` into the tiers; `prefetch` of those keys, so that disk
   blocks are on host by admission.
4. Admission: the same match and chain; `lookup` each chained block in order (stopping at the first
   miss: it was evicted meanwhile), write the blobs into the freshly allocated pages,
   `pool.register_restored`; the restored blocks count as cached prompt tokens, and the request
   replays its last `replay_tokens` cached tokens as after a device hit.
5. Shutdown: every block of the device cache is demoted, `spill()` writes host blocks to disk, then
   `close()`; the next start with the same directory and fingerprint finds them (step 3 reaches disk
   blocks from the root, as the device cache is empty).
Metrics: `tiers.stats` (counters, promotion latency samples) and `tiers.gauges()` (pages and bytes
per tier); exporting them is the caller's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from serving.scheduling.pages import block_key, scope_tag

MAGIC = b"CEDKVBLK"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = "LOCK"
MARKER_NAME = "CED_KV_DISK_TIER"
MARKER_TEXT = f"ced-jax KV disk tier: one block per file, format {FORMAT_VERSION}\n"
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kvb")
_TEMP_NAME = re.compile(r"[0-9a-f]{32}\.[0-9]+\.[0-9]+\.tmp")

log = logging.getLogger(__name__)
_DIGEST = 32
_FIXED = struct.Struct("<I16s16s16s16sIIQ")  # version, fingerprint, key, parent, scope, n_tok, extra, payload
_PREFIX = len(MAGIC) + _DIGEST


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMeta:
    """What links a stored block into the prefix chain (a `pages.CacheEntry` without its page)."""

    key: bytes
    parent: bytes
    scope: bytes  # scope tag (16 bytes)
    tokens: np.ndarray  # i32 [page_size]
    extra: bytes = b""


def make_meta(
    key: bytes, parent: bytes, tokens: Sequence[int] | np.ndarray, scope: bytes, extra: bytes = b""
) -> BlockMeta:
    """A `BlockMeta`, checking that `key` is the chain key of the block (`pages.block_key`)."""
    tokens = np.asarray(tokens, dtype=np.int32).copy()
    for name, value in (("key", key), ("parent_key", parent), ("scope", scope)):
        if not isinstance(value, bytes) or len(value) != 16:
            raise ValueError(f"{name}: expected 16 bytes, got {value!r:.40}")
    if tokens.ndim != 1 or not len(tokens):
        raise ValueError(f"tokens: expected a non-empty 1-D block, got shape {tokens.shape}")
    if block_key(parent, scope, tokens, extra) != key:
        raise ValueError("key: not block_key(parent_key, scope, tokens, extra)")
    tokens.flags.writeable = False
    return BlockMeta(key, parent, scope, tokens, extra)


# ------------------------------------------------------------------------------------ host tier


class HostTier:
    """An LRU of blobs in host memory within `max_bytes` of blob bytes. Not thread-safe by itself
    (`TieredKV` serialises access)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[BlockMeta, bytes]] = OrderedDict()  # oldest first
        self.bytes = 0

    @property
    def pages(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Keys, least recently used first."""
        return list(self._entries)

    def meta(self, key: bytes) -> BlockMeta | None:
        item = self._entries.get(key)
        return None if item is None else item[0]

    def items(self) -> list[tuple[BlockMeta, bytes]]:
        """(meta, blob) of every block, least recently used first (no entry is touched)."""
        return list(self._entries.values())

    def get(self, key: bytes) -> bytes | None:
        """The blob (and the entry becomes the most recently used), or None."""
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item[1]

    def put(self, meta: BlockMeta, blob: bytes) -> list[tuple[BlockMeta, bytes]]:
        """Stores the block as the most recently used; returns what no longer fits, oldest first
        (the block itself if it alone exceeds the budget)."""
        if meta.key in self._entries:
            self._entries.move_to_end(meta.key)
            return []
        if len(blob) > self.max_bytes:
            return [(meta, blob)]
        self._entries[meta.key] = (meta, blob)
        self.bytes += len(blob)
        out = []
        while self.bytes > self.max_bytes:
            _, (m, b) = self._entries.popitem(last=False)
            self.bytes -= len(b)
            out.append((m, b))
        return out


# ------------------------------------------------------------------------------------ disk tier


class CorruptBlock(Exception):
    """A block file that fails its checks (the message says which)."""


class ForeignBlock(CorruptBlock):
    """A well-formed block file of another format version or model fingerprint."""


def _encode(fingerprint: bytes, meta: BlockMeta, payload: bytes) -> list[bytes]:
    tokens = meta.tokens.astype("<i4").tobytes()
    fixed = _FIXED.pack(
        FORMAT_VERSION, fingerprint, meta.key, meta.parent, meta.scope, len(meta.tokens), len(meta.extra),
        len(payload),
    )  # fmt: skip
    h = hashlib.blake2b(digest_size=_DIGEST)
    for part in (fixed, tokens, meta.extra, payload):
        h.update(part)
    return [MAGIC + h.digest() + fixed + tokens + meta.extra, payload]


def _parse_header(head: bytes, fingerprint: bytes) -> tuple[BlockMeta, int, int]:
    """(meta, header bytes, payload bytes) of a file starting with `head` (at least the header)."""
    if len(head) < _PREFIX + _FIXED.size or head[: len(MAGIC)] != MAGIC:
        raise CorruptBlock("bad magic or short header")
    version, fp, key, parent, scope, n_tok, n_extra, n_payload = _FIXED.unpack_from(head, _PREFIX)
    if version != FORMAT_VERSION:
        raise ForeignBlock(f"format version {version}, expected {FORMAT_VERSION}")
    if fp != fingerprint:
        raise ForeignBlock("written by another model or page layout (fingerprint)")
    start = _PREFIX + _FIXED.size
    header = start + 4 * n_tok + n_extra
    if n_tok == 0 or len(head) < header:
        raise CorruptBlock("short header")
    tokens = np.frombuffer(head, "<i4", n_tok, start).astype(np.int32)
    extra = bytes(head[start + 4 * n_tok : header])
    try:
        meta = make_meta(key, parent, tokens, scope, extra)
    except ValueError as e:
        raise CorruptBlock(str(e)) from None
    return meta, header, n_payload


def _read_header(f) -> bytes:
    """The header bytes of an open block file (short if the file is)."""
    head = f.read(_PREFIX + _FIXED.size)
    if len(head) < _PREFIX + _FIXED.size:
        return head
    n_tok, n_extra = _FIXED.unpack_from(head, _PREFIX)[5:7]
    return head + f.read(4 * n_tok + n_extra)


def _write_temp(path: str, parts: Sequence[bytes]) -> None:
    """Writes and fsyncs a new file (the disk tier's only write; a module function so that the
    crash tests can stop a writer half-way)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier:
    """One file per block in `directory`, LRU within `max_bytes` of file bytes (module docstring).
    Thread-safe: index changes hold a lock, file reads do not."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, model_fingerprint: bytes):
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        if not isinstance(model_fingerprint, bytes) or len(model_fingerprint) != 16:
            raise ValueError("model_fingerprint: expected 16 bytes (PageLayout.fingerprint())")
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        self.fingerprint = model_fingerprint
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, tuple[BlockMeta, int]] = OrderedDict()  # key -> (meta, size)
        self.bytes = 0
        self._clock = 0  # last mtime (ns) given to a file: strictly increasing
        self._temp_seq = 0
        # what the start-up scan removed, and what reads rejected since
        self.stale_temp_removed = 0
        self.refused_removed = 0  # other format version or fingerprint
        self.corrupt_removed = 0
        self.evictions = 0
        self.write_errors = 0
        try:
            os.makedirs(self.directory, exist_ok=True)
            if _check_owned(self.directory):
                _write_marker(self.directory)
            self._lock_fd = os.open(os.path.join(self.directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RuntimeError(f"kv disk dir {self.directory}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"kv disk dir {self.directory} is in use by another process") from None
        self._scan()
        removed = self.stale_temp_removed + self.refused_removed + self.corrupt_removed
        if removed:
            log.info(
                "kv disk dir %s: removed %d block(s) of another model or format, %d corrupt, %d temporary",
                self.directory,
                self.refused_removed,
                self.corrupt_removed,
                self.stale_temp_removed,
            )

    @staticmethod
    def check_directory(directory: str | os.PathLike) -> None:
        """Raises RuntimeError if `directory` cannot be a disk tier now (not creatable or writable, or
        held by another process): a cheap check before a long start-up; the tier itself takes the lock."""
        directory = os.fspath(directory)
        try:
            os.makedirs(directory, exist_ok=True)
            if _check_owned(directory):
                _write_marker(directory)
            fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RuntimeError(f"kv disk dir {directory}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"kv disk dir {directory} is in use by another process") from None
        finally:
            os.close(fd)  # closing releases the lock

    # ---- start-up
    def _scan(self) -> None:
        found = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if _TEMP_NAME.fullmatch(name):
                self._unlink(path)
                self.stale_temp_removed += 1
                continue
            if not _BLOCK_NAME.fullmatch(name):
                continue  # not ours (LOCK, the marker, or anything a person put there)
            try:
                st = os.stat(path)
                with open(path, "rb") as f:
                    head = _read_header(f)
                meta, header, payload = _parse_header(head, self.fingerprint)
                if name != meta.key.hex() + SUFFIX:
                    raise CorruptBlock("file name is not its key")
                if st.st_size != header + payload:
                    raise CorruptBlock(f"size {st.st_size}, header says {header + payload}")
            except ForeignBlock:
                self.refused_removed += 1
                self._unlink(path)
                continue
            except CorruptBlock:
                self.corrupt_removed += 1
                self._unlink(path)
                continue
            found.append((st.st_mtime_ns, name, meta, st.st_size))
        found.sort(key=lambda f: (f[0], f[1]))
        for mtime, _, meta, size in found:
            self._index[meta.key] = (meta, size)
            self.bytes += size
            self._clock = max(self._clock, mtime)
        with self._lock:
            self._evict_to(self.max_bytes)

    # ---- queries
    @property
    def pages(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def keys(self) -> list[bytes]:
        """Keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def meta(self, key: bytes) -> BlockMeta | None:
        item = self._index.get(key)
        return None if item is None else item[0]

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + SUFFIX)

    # ---- reads and writes
    def get(self, key: bytes) -> bytes | None:
        """The block's payload, verified, and the block becomes the most recently used; None if it
        is not stored or fails its checks (then it is deleted)."""
        if key not in self._index:
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        try:
            meta, header, n_payload = _parse_header(data, self.fingerprint)
            if meta.key != key:
                raise CorruptBlock("key differs from the file name")
            if len(data) != header + n_payload:
                raise CorruptBlock(f"{len(data)} bytes, header says {header + n_payload}")
            digest = hashlib.blake2b(memoryview(data)[_PREFIX:], digest_size=_DIGEST).digest()
            if digest != data[len(MAGIC) : _PREFIX]:
                raise CorruptBlock("checksum mismatch")
        except CorruptBlock as e:
            log.warning("kv disk dir %s: block %s is corrupt (%s); removed", self.directory, key.hex(), e)
            with self._lock:
                self.corrupt_removed += 1
                self._forget(key)
                self._unlink(path)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                self._touch(path)
        return data[header:]

    def put(self, meta: BlockMeta, payload: bytes) -> bool:
        """Stores the block as the most recently used (atomically; evicting LRU files to stay within
        budget). False if it cannot be stored (larger than the budget, or an OS error)."""
        with self._lock:
            if meta.key in self._index:
                self._index.move_to_end(meta.key)
                self._touch(self.path(meta.key))
                return True
            self._temp_seq += 1
            temp = os.path.join(
                self.directory, f"{meta.key.hex()}.{os.getpid()}.{self._temp_seq}{TEMP_SUFFIX}"
            )
        parts = _encode(self.fingerprint, meta, payload)
        size = sum(len(p) for p in parts)
        if size > self.max_bytes:
            return False
        try:
            _write_temp(temp, parts)
        except OSError as e:
            log.warning("kv disk dir %s: writing a block failed: %s", self.directory, e.strerror or e)
            with self._lock:
                self.write_errors += 1
            self._unlink(temp)
            return False
        with self._lock:
            if meta.key in self._index:  # another writer got there first
                self._unlink(temp)
                return True
            self._evict_to(self.max_bytes - size)
            try:
                os.replace(temp, self.path(meta.key))
            except OSError:
                self.write_errors += 1
                self._unlink(temp)
                return False
            self._index[meta.key] = (meta, size)
            self.bytes += size
            self._touch(self.path(meta.key))
        try:
            self._fsync_dir()  # the rename itself is durable once the directory is
        except OSError:
            pass
        return True

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # ---- internals (callers hold self._lock where the index changes)
    def _evict_to(self, budget: int) -> None:
        while self._index and self.bytes > budget:
            key, _ = next(iter(self._index.items()))
            self.evictions += 1
            self._forget(key)
            self._unlink(self.path(key))

    def _forget(self, key: bytes) -> None:
        item = self._index.pop(key, None)
        if item is not None:
            self.bytes -= item[1]

    def _touch(self, path: str) -> None:
        self._clock = max(self._clock + 1, time.time_ns())
        try:
            os.utime(path, ns=(self._clock, self._clock))
        except OSError:
            pass  # the order on disk is a hint for the next start-up only

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _check_owned(directory: str) -> bool:
    """Raises RuntimeError for a directory that holds other files but not the tier's marker; True if
    the directory is to be marked (before anything is written in it)."""
    marker = os.path.join(directory, MARKER_NAME)
    if os.path.isfile(marker):
        return False
    names = os.listdir(directory)
    # A directory of a tier from before the marker holds only the tier's own names: adopted.
    own = (_BLOCK_NAME.fullmatch, _TEMP_NAME.fullmatch, LOCK_NAME.__eq__)
    foreign = [n for n in names if not any(match(n) for match in own)]
    if foreign:
        raise RuntimeError(
            f"kv disk dir {directory}: not empty and not a KV disk tier (no {MARKER_NAME} file; "
            f"{len(foreign)} other entries, e.g. {sorted(foreign)[0]!r}): give an empty or new directory"
        )
    return True


def _write_marker(directory: str) -> None:
    temp = os.path.join(directory, f"{MARKER_NAME}.{os.getpid()}.partial")
    with open(temp, "w") as f:
        f.write(MARKER_TEXT)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(directory, MARKER_NAME))


# ------------------------------------------------------------------------------------- tiers


@dataclasses.dataclass
class TierStats:
    """Counters since start (gauges: `TieredKV.gauges()`)."""

    demotions: int = 0  # blocks handed to `demote`
    host_evictions: int = 0  # blocks host pressure pushed out (to disk, or dropped without one)
    host_to_disk: int = 0  # of which handed to the disk (written, or already there)
    dropped: int = 0  # blocks no tier could keep (host pressure without a disk, or disk refused)
    backlog_drops: int = 0  # of which because too many blocks were waiting for their disk write
    hits_host: int = 0
    hits_disk: int = 0
    misses: int = 0
    promotions: int = 0  # disk -> host, by lookup or prefetch
    prefetched: int = 0  # of which by prefetch
    promotion_latency_s: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=1024)
    )  # disk read + verify + insert, per promoted block (latest 1024)


class TieredKV:
    """Host memory over an optional disk, below the device pages (module docstring). Thread-safe.

    Disk writes run on `writer_threads` background threads (a write is dominated by its fsync, and
    concurrent fsyncs share journal commits: 14 KB pages went from 2.2 MB/s with one thread to
    26 MB/s with four on an ext4 VM disk), prefetches on one more. Blocks pushed off host wait in
    memory for their write; past `max_pending_bytes` of them a block pushed down is dropped instead
    (`stats.backlog_drops`), so a disk slower than the eviction rate cannot grow host memory without
    bound. With one writer thread the disk's LRU order is the order blocks were pushed down; with
    several, blocks pushed together may land in either order."""

    def __init__(
        self,
        host: HostTier,
        disk: DiskTier | None = None,
        *,
        writer_threads: int = 4,
        max_pending_bytes: int = 256 << 20,
    ):
        if writer_threads < 1:
            raise ValueError(f"writer_threads: must be >= 1, got {writer_threads}")
        if max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes: must be >= 0, got {max_pending_bytes}")
        self.host = host
        self.disk = disk
        self.max_pending_bytes = max_pending_bytes
        self.stats = TierStats()
        self._lock = threading.RLock()
        self._pending: dict[bytes, tuple[BlockMeta, bytes]] = {}  # pushed off host, not yet on disk
        self._pending_bytes = 0
        self._inflight: dict[bytes, concurrent.futures.Future] = {}  # key -> its prefetch
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=writer_threads, thread_name_prefix="kv-write"
        )
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-read")
        self._futures: set[concurrent.futures.Future] = set()
        self._futures_lock = threading.Lock()

    # ---- gauges
    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {
                "host_pages": self.host.pages,
                "host_bytes": self.host.bytes,
                "pending_pages": len(self._pending),
                "pending_bytes": self._pending_bytes,
                "disk_pages": self.disk.pages if self.disk else 0,
                "disk_bytes": self.disk.bytes if self.disk else 0,
                "disk_evictions": self.disk.evictions if self.disk else 0,
                "disk_corrupt_removed": self.disk.corrupt_removed if self.disk else 0,
                "disk_write_errors": self.disk.write_errors if self.disk else 0,
                "disk_refused_removed": self.disk.refused_removed if self.disk else 0,
                "disk_stale_temp_removed": self.disk.stale_temp_removed if self.disk else 0,
            }

    # ---- demotion
    def demote(
        self,
        key: bytes,
        parent_key: bytes,
        tokens: Sequence[int] | np.ndarray,
        blob: bytes,
        *,
        scope: bytes | None = None,
        extra: bytes = b"",
    ) -> None:
        """Keeps a block the device cache evicted: on host, pushing host LRU blocks to disk.
        `scope` is the block's scope tag (`CacheEntry.scope`; default: the shared scope's)."""
        meta = make_meta(key, parent_key, tokens, scope_tag("") if scope is None else scope, extra)
        blob = bytes(blob)
        with self._lock:
            self.stats.demotions += 1
            self._to_host(meta, blob)

    def _to_host(self, meta: BlockMeta, blob: bytes) -> None:
        for m, b in self.host.put(meta, blob):
            self._push_down(m, b)

    def _push_down(self, meta: BlockMeta, blob: bytes) -> None:
        self.stats.host_evictions += 1
        if self.disk is None:
            self.stats.dropped += 1
            return
        self.stats.host_to_disk += 1
        if meta.key in self.disk:
            self._submit(self._writer, self.disk.put, meta, blob)  # refreshes its LRU position
            return
        if meta.key in self._pending:
            return  # its write is queued already
        if self._pending_bytes + len(blob) > self.max_pending_bytes:
            self.stats.dropped += 1
            self.stats.backlog_drops += 1
            return
        self._pending[meta.key] = (meta, blob)
        self._pending_bytes += len(blob)
        self._submit(self._writer, self._write, meta, blob)

    def _write(self, meta: BlockMeta, blob: bytes) -> None:
        ok = False
        try:
            ok = self.disk.put(meta, blob)
        finally:
            with self._lock:
                if self._pending.pop(meta.key, None) is not None:
                    self._pending_bytes -= len(blob)
                if not ok:
                    self.stats.dropped += 1

    # ---- lookups
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self.host or key in self._pending or (self.disk is not None and key in self.disk)

    def meta(self, key: bytes) -> BlockMeta | None:
        with self._lock:
            m = self.host.meta(key)
            if m is None and key in self._pending:
                m = self._pending[key][0]
            if m is None and self.disk is not None:
                m = self.disk.meta(key)
            return m

    def lookup(self, key: bytes) -> tuple[bytes, str] | None:
        """(blob, "host" | "disk") for a stored block, or None. A disk hit is promoted to host."""
        with self._lock:
            blob = self.host.get(key)
            if blob is None and key in self._pending:
                meta, blob = self._pending[key]
                self._to_host(meta, blob)  # back on host; the disk write goes on
            if blob is not None:
                self.stats.hits_host += 1
                return blob, "host"
        blob = self._promote(key) if self.disk is not None else None
        with self._lock:
            if blob is not None:
                self.stats.hits_disk += 1
                return blob, "disk"
            self.stats.misses += 1
        return None

    def _promote(self, key: bytes, *, prefetch: bool = False) -> bytes | None:
        """Reads a disk block into host memory (if it fits there) and returns it; None if it is not
        on disk or failed its checks."""
        t0 = time.perf_counter()
        meta = self.disk.meta(key)
        blob = self.disk.get(key)
        if blob is None or meta is None:
            return None
        with self._lock:
            if key in self.host:  # a prefetch and a lookup both read it: count it once
                self.host.get(key)
                return blob
            self._to_host(meta, blob)
            self.stats.promotions += 1
            self.stats.prefetched += prefetch
            self.stats.promotion_latency_s.append(time.perf_counter() - t0)
        return blob

    def chain(
        self,
        parent: bytes,
        tag: bytes,
        token_ids: Sequence[int] | np.ndarray,
        page_size: int,
        *,
        start_block: int = 0,
        max_blocks: int | None = None,
        block_extras: Sequence[bytes] | None = None,
    ) -> list[BlockMeta]:
        """The stored blocks that continue the chain at `parent` (the key of block start_block - 1,
        ROOT_KEY for none) with blocks start_block, start_block + 1, ... of `token_ids`, in scope
        `tag`, up to the first one no tier holds (tokens and extra compared, as `PagePool.match`).
        block_extras[i]: block i's `block_key` extra (indexed from block 0)."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        n = len(tokens) // page_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        out, key = [], parent
        for i in range(start_block, n):
            block = tokens[i * page_size : (i + 1) * page_size]
            extra = block_extras[i] if block_extras is not None else b""
            key = block_key(key, tag, block, extra)
            meta = self.meta(key)
            if meta is None or not np.array_equal(meta.tokens, block) or meta.extra != extra:
                break
            out.append(meta)
        return out

    def prefetch(self, keys: Iterable[bytes]) -> concurrent.futures.Future:
        """Starts reading the disk blocks among `keys` into host memory on the background thread;
        the future gives how many were promoted."""
        with self._lock:
            todo = [
                k
                for k in dict.fromkeys(keys)
                if self.disk is not None
                and k in self.disk
                and k not in self.host
                and k not in self._pending
                and k not in self._inflight
            ]
            future = self._submit(self._reader, self._prefetch_all, todo)
            for k in todo:
                self._inflight[k] = future
        return future

    def _prefetch_all(self, keys: list[bytes]) -> int:
        done = 0
        try:
            for k in keys:
                with self._lock:
                    if k in self.host:
                        continue
                done += self._promote(k, prefetch=True) is not None
        finally:
            with self._lock:
                for k in keys:
                    self._inflight.pop(k, None)
        return done

    # ---- lifecycle
    def _submit(self, worker, fn, *args) -> concurrent.futures.Future:
        future = worker.submit(fn, *args)
        with self._futures_lock:
            self._futures.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._futures_lock:
            self._futures.discard(future)

    def flush(self) -> None:
        """Waits for the background writes and prefetches submitted so far."""
        while True:
            with self._futures_lock:
                pending = list(self._futures)
            if not pending:
                return
            concurrent.futures.wait(pending)

    def spill(self) -> None:
        """Writes every host block that is not on disk yet to disk (oldest first, so the disk's LRU
        order follows the host's) and waits: before a restart that should find them (warm restart).
        The blocks stay on host."""
        if self.disk is None:
            return
        with self._lock:
            items = self.host.items()
        for meta, blob in items:
            self._submit(self._writer, self.disk.put, meta, blob)
        self.flush()

    def close(self) -> None:
        """Finishes the pending disk writes and releases the disk directory (host blocks are not
        written: `spill` first to keep them)."""
        self.flush()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
