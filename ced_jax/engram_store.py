"""Engram tables off device: the host-side store that gathers each step's rows.

With the Engram placement `host` (`ced_jax.load(..., engram_placement=...)`, `Engine`) the two
Engram tables (203 GB = 189 GiB with scales in the release) never go to the accelerators: the parameter
tree has no `layers.{i}.engram.embed` leaves, and each step's inputs carry the gathered rows instead
of their ids. The row ids are what `ced_jax.engram_hash.EngramHasher` computes on the host anyway;
`EngramStore.gather` turns ids i32 [B, T, n_engram_layers, C] into
{"weight": FP8 e4m3 [B, T, n_engram_layers, C, ehd], "scale": ue8m0 bytes [..., ehd / 32]}, and the
layer dequantises them with the same ops it applies after its on-device gather
(`ced_jax.model.layers.engram.engram_dequant`), so logits are bit-identical between the placements.

Tables come from numpy arrays (the tiny preset, HF and Orbax loads: `from_flat`) or from raw
row-major files memory-mapped read-only (`open_raw`), which `convert_weights` writes beside its
Orbax items (`RAW_DIR`). Per leaf (`layers.{i}.engram.embed.weight` / `.scale`) there are two files:
`{leaf}.bin`, the C-order bytes of the array and nothing else, and `{leaf}.json`, its header:
{"format": RAW_FORMAT, "version": RAW_VERSION, "leaf", "shape", "dtype", "nbytes", "config_hash"}.
`config_hash` is `engram_config_hash(cfg)`, a SHA-256 over the config fields that decide what the
table rows mean (every `engram_*` field and the vocabulary size); a file whose header disagrees with
the config it is opened for (hash, shape, dtype, size) is refused with `EngramStoreError` naming the
file and the field. Only the rows a step names are read (page cache / disk), never the whole table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from ced_jax.config import ModelConfig

PLACEMENTS = ("host", "device")
RAW_DIR = "engram_raw"
RAW_FORMAT = "ced-jax/engram-raw"
RAW_VERSION = 1
SCALE_BLOCK = 32  # one ue8m0 scale per 32 columns of a row
# Gathering from mapped files: threads taking pieces of the rows (disk reads in flight), about
# two pieces per thread, of at least MIN_PIECE_ROWS rows each.
GATHER_THREADS = 16
MIN_PIECE_ROWS = 8

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(np.uint8)


class EngramStoreError(ValueError):
    """A raw Engram file that cannot serve this config, or arrays of the wrong shape / dtype."""


def table_leaves(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(weight leaf, scale leaf) dotted paths of each Engram layer's table, in `engram_layer_ids` order."""
    return [
        (f"layers.{i}.engram.embed.weight", f"layers.{i}.engram.embed.scale") for i in cfg.engram_layer_ids
    ]


def table_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """leaf -> (shape, dtype) of every Engram table leaf (FP8 rows, ue8m0 scales)."""
    out = {}
    ehd = cfg.engram_head_dim
    for (w, s), rows in zip(table_leaves(cfg), cfg.engram_num_embeddings, strict=True):
        out[w] = ((rows, ehd), FP8)
        out[s] = ((rows, -(-ehd // SCALE_BLOCK)), E8M0)
    return out


def engram_config_hash(cfg: ModelConfig) -> str:
    """SHA-256 (hex) of the config fields that decide what the table rows mean."""
    fields = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name.startswith("engram_") or f.name == "vocab_size"
    }
    blob = json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in sorted(fields.items())})
    return hashlib.sha256(blob.encode()).hexdigest()


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"engram_placement: expected one of {list(PLACEMENTS)}, got {placement!r}")
    return placement


# ---------------------------------------------------------------------- raw files
def raw_header(cfg: ModelConfig, leaf: str, shape, dtype) -> dict:
    dtype = np.dtype(dtype)
    return {
        "format": RAW_FORMAT,
        "version": RAW_VERSION,
        "leaf": leaf,
        "shape": [int(d) for d in shape],
        "dtype": dtype.name,
        "nbytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
        "config_hash": engram_config_hash(cfg),
    }


def write_raw(directory: str | Path, cfg: ModelConfig, leaf: str, array: np.ndarray) -> Path:
    """Write one table leaf as `{leaf}.bin` (C-order bytes) + `{leaf}.json` (header) under `directory`
    (created if needed), in bounded pieces (the array may itself be a memmap). Returns the .bin path."""
    want = table_specs(cfg).get(leaf)
    if want is None:
        raise EngramStoreError(f"{leaf}: not an Engram table leaf of this config")
    if tuple(array.shape) != want[0] or np.dtype(array.dtype) != want[1]:
        raise EngramStoreError(
            f"{leaf}: array is {np.dtype(array.dtype).name} {list(array.shape)}, "
            f"the config needs {want[1].name} {list(want[0])}"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{leaf}.bin"
    rows_per_piece = max(1, (64 << 20) // max(1, array[0].nbytes)) if len(array) else 1
    with open(path, "wb") as f:
        for begin in range(0, len(array), rows_per_piece):
            f.write(np.ascontiguousarray(array[begin : begin + rows_per_piece]).view(np.uint8).tobytes())
    header = raw_header(cfg, leaf, array.shape, array.dtype)
    (directory / f"{leaf}.json").write_text(json.dumps(header, indent=1) + "\n")
    return path


def has_raw(directory: str | Path, cfg: ModelConfig) -> bool:
    """Whether `directory` holds a header for every Engram table leaf of `cfg`."""
    directory = Path(directory)
    return bool(cfg.engram_layer_ids) and all(
        (directory / f"{leaf}.json").is_file() for leaf in table_specs(cfg)
    )


def _open_leaf(directory: Path, cfg: ModelConfig, leaf: str, shape, dtype) -> np.ndarray:
    header_path, data_path = directory / f"{leaf}.json", directory / f"{leaf}.bin"
    try:
        header = json.loads(header_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EngramStoreError(f"{header_path}: cannot read the header ({e})") from None
    want = raw_header(cfg, leaf, shape, dtype)
    if header.get("format") != RAW_FORMAT or header.get("version") != RAW_VERSION:
        raise EngramStoreError(
            f"{header_path}: format {header.get('format')!r} v{header.get('version')}, "
            f"this build reads {RAW_FORMAT!r} v{RAW_VERSION}"
        )
    for key in ("leaf", "config_hash", "shape", "dtype", "nbytes"):
        if header.get(key) != want[key]:
            what = (
                "written for another Engram config" if key == "config_hash" else "does not match the config"
            )
            raise EngramStoreError(
                f"{header_path}: {key} is {header.get(key)!r}, the config needs {want[key]!r} ({what})"
            )
    try:
        size = data_path.stat().st_size
    except OSError as e:
        raise EngramStoreError(f"{data_path}: cannot open the table ({e.strerror or e})") from None
    if size != want["nbytes"]:
        raise EngramStoreError(f"{data_path}: {size} bytes, the header says {want['nbytes']}")
    return map_readonly(data_path, dtype, shape)


def map_readonly(path: Path, dtype, shape) -> np.ndarray:
    """A read-only array over the file's bytes, memory-mapped with MADV_RANDOM: a step touches a few
    scattered rows, and the kernel's default read-ahead around each fault (read_ahead_kb, 8 MiB on
    this project's machines) made one cold row cost ~5 ms instead of ~20 us (bench/engram_host.py)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=np.dtype(dtype)).reshape(tuple(shape))


# ---------------------------------------------------------------------- the store
class EngramStore:
    """The Engram tables of one model in host memory (numpy arrays or read-only memmaps), one
    (weight FP8 [rows, ehd], scale ue8m0 [rows, ehd / 32]) pair per Engram layer, in
    `cfg.engram_layer_ids` order."""

    def __init__(self, cfg: ModelConfig, tables: list[tuple[np.ndarray, np.ndarray]]):
        specs = table_specs(cfg)
        if len(tables) != len(cfg.engram_layer_ids):
            raise EngramStoreError(
                f"tables: {len(tables)} given, the config has {len(cfg.engram_layer_ids)} Engram layers"
            )
        for leaves, pair in zip(table_leaves(cfg), tables, strict=True):
            for leaf, arr in zip(leaves, pair, strict=True):
                shape, dtype = specs[leaf]
                if tuple(arr.shape) != shape or np.dtype(arr.dtype) != dtype:
                    raise EngramStoreError(
                        f"{leaf}: {np.dtype(arr.dtype).name} {list(arr.shape)}, the config needs "
                        f"{dtype.name} {list(shape)}"
                    )
        self.cfg = cfg
        self.tables = tables
        self.files: list[Path] = []  # the raw files mapped (`open_raw`), else empty
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def pop_from_flat(cls, cfg: ModelConfig, flat: dict[str, np.ndarray]) -> EngramStore:
        """The store of the table leaves of a flat {dotted path: array} dict, removed from it."""
        missing = [leaf for leaf in table_specs(cfg) if leaf not in flat]
        if missing:
            raise EngramStoreError(f"Engram table leaves missing from the parameters: {missing}")
        return cls(cfg, [(np.asarray(flat.pop(w)), np.asarray(flat.pop(s))) for w, s in table_leaves(cfg)])

    @classmethod
    def from_flat(cls, cfg: ModelConfig, flat: Mapping[str, np.ndarray]) -> EngramStore:
        """The store of the table leaves of a flat dict (left in it)."""
        return cls(cfg, [(np.asarray(flat[w]), np.asarray(flat[s])) for w, s in table_leaves(cfg)])

    @classmethod
    def open_raw(cls, directory: str | Path, cfg: ModelConfig) -> EngramStore:
        """Memory-map the raw files under `directory` (see the module docstring), headers checked;
        `files` lists them."""
        directory = Path(directory)
        specs = table_specs(cfg)
        tables = [
            tuple(_open_leaf(directory, cfg, leaf, *specs[leaf]) for leaf in pair)
            for pair in table_leaves(cfg)
        ]
        store = cls(cfg, tables)
        store.files = [directory / f"{leaf}.bin" for pair in table_leaves(cfg) for leaf in pair]
        return store

    @property
    def nbytes(self) -> int:
        """Bytes of all tables (weights and scales)."""
        return sum(int(w.nbytes) + int(s.nbytes) for w, s in self.tables)

    @property
    def bytes_per_token(self) -> int:
        """Bytes gathered per token: layers x C rows x (ehd FP8 + ehd / 32 scale bytes)."""
        return sum(
            self.cfg.engram_hash_cols * (w.shape[1] * w.itemsize + s.shape[1] * s.itemsize)
            for w, s in self.tables
        )

    def gather(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """ids i32 [..., n_engram_layers, C] (from `EngramHasher.hash_ids`) -> {"weight": FP8
        [..., n_engram_layers, C, ehd], "scale": uint8 [..., n_engram_layers, C, ehd / 32]}: the
        table rows, byte for byte."""
        ids = np.asarray(ids)
        n = len(self.tables)
        if ids.ndim < 2 or ids.shape[-2] != n or not np.issubdtype(ids.dtype, np.integer):
            raise EngramStoreError(f"ids: expected integers [..., {n}, C], got {ids.dtype} {list(ids.shape)}")
        lead = ids.shape[:-2]
        cols = ids.shape[-1]
        w0, s0 = self.tables[0]
        # [n, rows, width] per part, transposed into [..., n, C, width] at the end
        flat = np.moveaxis(ids, -2, 0).reshape(n, -1)
        weight = np.empty((n, flat.shape[1], w0.shape[1]), w0.dtype)
        scale = np.empty((n, flat.shape[1], s0.shape[1]), s0.dtype)
        jobs = []
        for k, (w, s) in enumerate(self.tables):
            rows = flat[k]
            if rows.size and (rows.min() < 0 or rows.max() >= len(w)):
                raise EngramStoreError(
                    f"ids: layer {k} rows must be in [0, {len(w)}), got {rows.min()}..{rows.max()}"
                )
            jobs += [(w, rows, weight[k]), (s, rows, scale[k])]
        if self.files:
            # Mapped files: a row not in the page cache is a disk read taken by the faulting thread,
            # so pieces run on threads to keep several reads in flight (np.take releases the GIL).
            step = max(MIN_PIECE_ROWS, -(-len(jobs) * flat.shape[1] // (2 * GATHER_THREADS)))
            pieces = [
                (table, rows[i : i + step], out[i : i + step])
                for table, rows, out in jobs
                for i in range(0, len(rows), step)
            ]
            list(self._pool().map(_take_into, pieces))
        else:  # tables in memory: one take per table (a decode step's few rows: pieces only cost calls)
            for job in jobs:
                _take_into(job)
        shape = lambda a: np.moveaxis(a.reshape(n, *lead, cols, a.shape[-1]), 0, -3)
        return {"weight": np.ascontiguousarray(shape(weight)), "scale": np.ascontiguousarray(shape(scale))}

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="engram-gather")
        return self._executor


def _take_into(piece) -> None:
    table, rows, out = piece
    np.take(table, rows, axis=0, out=out)  # on a mapped file: only the pages of these rows
