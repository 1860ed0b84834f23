"""Copying whole KV pages out of and back into the device state, and their host byte layout.

What persists of a cached prefix is its compressed global KV (spec 2.4, issue 13): for each KV source
layer s, page p's rows of `PagedCache.kv[s]` (FP4 main entries) and `PagedCache.index_k[s]` (FP4 index
keys). Everything else in the state (SWA rings, compressor partial groups, draft rings) is per slot
and is rebuilt by replaying the cached tokens, so it is not part of a page.

Device side, two pure functions (jit-able; nothing is changed in place):
- `read_pages(state, pages)` -> {"kv": {src: u8 [n, E_src, main_bytes]},
                                  "index_k": {src: u8 [n, E_src, key_bytes]}}
- `write_pages(state, pages, contents)` -> a new `PagedCache` whose pages hold `contents`.
Under `jax.jit` every distinct n is a separate program: callers bucket n (pad with repeats of a
page for reads; writes must not repeat a page, see `write_pages`).

Host side, `PageLayout` fixes one contiguous byte string per page: for each KV source in the config's
`kv_source_layer_ids` order, the source's main entries (E_src x fp4_entry_bytes, entry-major, as the
device buffer stores them) then its index keys (E_src x index_key_bytes). Nothing else is added, so a
page's blob is exactly its device bytes: `kv_bytes_per_token x page_size` (890 x page_size for
v41-flash, 210 x page_size for tiny). `PageLayout.fingerprint()` hashes the config, the layout and
the format version (plus what the caller says identifies the weights) for stores that outlive the
process (`serving/scheduling/kv_tiers.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from ced_jax.cache import PagedCache, kv_bytes_per_token
from ced_jax.config import ModelConfig
from pallas_kernels import formats

KINDS = ("kv", "index_k")
LAYOUT_VERSION = 1  # bump when the byte layout of a page changes


# ----------------------------------------------------------------------------------- device side


def _concrete(pages) -> np.ndarray | None:
    """The page ids as numpy when they are known now (not traced), else None."""
    if isinstance(pages, jax.core.Tracer):
        return None
    return np.asarray(pages)


def _check_pages(state: PagedCache, pages, *, unique: bool) -> None:
    if jnp.ndim(pages) != 1:
        raise ValueError(f"pages: expected a 1-D array of page ids, got shape {jnp.shape(pages)}")
    if not jnp.issubdtype(jnp.result_type(pages), jnp.integer):
        raise ValueError(f"pages: expected integer page ids, got {jnp.result_type(pages)}")
    ids = _concrete(pages)
    if ids is None:
        return
    num_pages = next(iter(state.kv.values())).shape[0] if state.kv else 0
    if ids.size and (ids.min() < 0 or ids.max() >= num_pages):
        raise ValueError(f"pages: ids must lie in [0, {num_pages}), got {ids.min()}..{ids.max()}")
    if unique and len(np.unique(ids)) != len(ids):
        raise ValueError("pages: a page may be written once per call (repeated ids)")


def read_pages(state: PagedCache, pages: jax.Array) -> dict:
    """Every page buffer's rows for `pages` (i32 [n]): {"kv": {src: u8 [n, ...]}, "index_k": {...}}.

    Page ids outside [0, num_pages) are an error when the ids are concrete; traced ids are clamped by
    the gather, so a traced caller must pass valid ids."""
    _check_pages(state, pages, unique=False)
    pages = jnp.asarray(pages, jnp.int32)
    return {kind: {src: buf[pages] for src, buf in getattr(state, kind).items()} for kind in KINDS}


def write_pages(state: PagedCache, pages: jax.Array, contents: dict) -> PagedCache:
    """The state with page `pages[i]` of every page buffer replaced by row i of `contents` (the
    structure `read_pages` returns, u8). Only the page buffers change; the result is a new state.

    `pages` must not repeat an id (the scatter would pick one row arbitrarily): checked when the ids
    are concrete. Traced ids outside [0, num_pages) are dropped."""
    _check_pages(state, pages, unique=True)
    pages = jnp.asarray(pages, jnp.int32)
    n = pages.shape[0]
    new = {}
    for kind in KINDS:
        buffers = getattr(state, kind)
        given = contents.get(kind) if isinstance(contents, dict) else None
        if given is None or set(given) != set(buffers):
            have = None if given is None else sorted(given)
            raise ValueError(f"contents[{kind!r}]: expected sources {sorted(buffers)}, got {have}")
        out = {}
        for src, buf in buffers.items():
            rows = given[src]
            want = (n, *buf.shape[1:])
            if tuple(rows.shape) != want or rows.dtype != buf.dtype:
                raise ValueError(
                    f"contents[{kind!r}][{src!r}]: expected {buf.dtype} {want}, "
                    f"got {rows.dtype} {tuple(rows.shape)}"
                )
            out[src] = buf.at[pages].set(rows, mode="drop")
        new[kind] = out
    return dataclasses.replace(state, kv=new["kv"], index_k=new["index_k"])


# ------------------------------------------------------------------------------------- host side


@dataclasses.dataclass(frozen=True)
class Segment:
    """One buffer's share of a page blob: bytes [offset, offset + entries * width)."""

    kind: str  # "kv" | "index_k"
    source: str  # KV source layer id, as the state's dict keys spell it
    entries: int  # entries per page (page_size / ratio)
    width: int  # bytes per entry
    offset: int

    @property
    def nbytes(self) -> int:
        return self.entries * self.width


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The fixed byte layout of one page (module docstring). Build it with `for_config`."""

    page_size: int
    segments: tuple[Segment, ...]
    config_json: str  # the config's HF dict, canonical JSON (for the fingerprint)

    @classmethod
    def for_config(cls, cfg: ModelConfig, page_size: int) -> PageLayout:
        if page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {page_size}")
        segments, offset = [], 0
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            if page_size % r:
                raise ValueError(f"page_size {page_size} is not a multiple of layer {s}'s compress ratio {r}")
            for kind, width in (
                ("kv", formats.fp4_entry_bytes(cfg.head_dim)),
                ("index_k", formats.index_key_bytes(cfg.index_head_dim)),
            ):
                seg = Segment(kind, str(s), page_size // r, width, offset)
                segments.append(seg)
                offset += seg.nbytes
        config_json = json.dumps(cfg.to_hf_dict(), sort_keys=True, separators=(",", ":"))
        return cls(page_size, tuple(segments), config_json)

    @property
    def page_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def check_state(self, state: PagedCache) -> None:
        """Raises ValueError unless `state`'s page buffers are the ones this layout describes, and
        asserts that a page's blob is exactly its share of `kv_bytes_per_token`."""
        if state.page_size != self.page_size:
            raise ValueError(f"state.page_size: layout has {self.page_size}, state {state.page_size}")
        for seg in self.segments:
            buf = getattr(state, seg.kind).get(seg.source)
            if buf is None or tuple(buf.shape[1:]) != (seg.entries, seg.width) or buf.dtype != jnp.uint8:
                got = None if buf is None else f"{buf.dtype} {tuple(buf.shape)}"
                raise ValueError(
                    f"state.{seg.kind}[{seg.source!r}]: expected u8 [*, {seg.entries}, {seg.width}], "
                    f"got {got}"
                )
        for kind in KINDS:
            extra = set(getattr(state, kind)) - {s.source for s in self.segments if s.kind == kind}
            if extra:
                raise ValueError(f"state.{kind}: sources {sorted(extra)} are not in the layout")
        assert self.page_bytes == kv_bytes_per_token(state) * self.page_size

    def fingerprint(self, weights: bytes = b"") -> bytes:
        """16 bytes naming what a stored page means: layout version, config, page layout and
        `weights` (whatever identifies the checkpoint; two models with one config but different
        weights write different KV, so pass it whenever pages outlive the process)."""
        h = hashlib.blake2b(digest_size=16, person=b"ced-page-layout")
        h.update(LAYOUT_VERSION.to_bytes(4, "little"))
        h.update(self.config_json.encode())
        h.update(json.dumps([dataclasses.astuple(s) for s in self.segments]).encode())
        h.update(len(weights).to_bytes(8, "little") + weights)
        return h.digest()

    def pack(self, contents: dict) -> list[bytes]:
        """A `read_pages` result (device or numpy arrays) -> one blob of `page_bytes` per page."""
        parts, n = [], None
        for seg in self.segments:
            try:
                rows = np.asarray(contents[seg.kind][seg.source])
            except KeyError:
                raise ValueError(f"contents[{seg.kind!r}][{seg.source!r}]: missing") from None
            if n is None:
                n = rows.shape[0] if rows.ndim else 0
            if rows.shape != (n, seg.entries, seg.width) or rows.dtype != np.uint8:
                raise ValueError(
                    f"contents[{seg.kind!r}][{seg.source!r}]: expected uint8 {(n, seg.entries, seg.width)}, "
                    f"got {rows.dtype} {rows.shape}"
                )
            parts.append(rows.reshape(n, seg.nbytes))
        flat = np.concatenate(parts, axis=1) if parts else np.zeros((0, 0), np.uint8)
        return [row.tobytes() for row in flat]

    def unpack(self, blobs: list[bytes]) -> dict:
        """Blobs of `page_bytes` each -> the `read_pages` structure as numpy u8 arrays [n, E, width]."""
        for i, b in enumerate(blobs):
            if len(b) != self.page_bytes:
                raise ValueError(f"blobs[{i}]: expected {self.page_bytes} bytes, got {len(b)}")
        flat = np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), self.page_bytes)
        out: dict = {kind: {} for kind in KINDS}
        for seg in self.segments:
            rows = flat[:, seg.offset : seg.offset + seg.nbytes].reshape(len(blobs), seg.entries, seg.width)
            out[seg.kind][seg.source] = rows.copy()
        return out
