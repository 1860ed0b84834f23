"""Load a released-layout HF checkpoint straight onto a device mesh, each process reading only the
byte ranges of the shards its devices hold.

`load_hf_onto_mesh(directory, cfg, shardings, ...)` returns `(params, report)` like
`hf_loader.load_hf_checkpoint`, except that every parameter named in `shardings` comes back as a
global `jax.Array` laid out by its sharding, built with `jax.make_array_from_callback`: the callback
of one device reads, for each HF tensor behind the parameter, only the rows of the leading dimension
its block covers (rows of a row-major tensor are one contiguous byte range of the file; a block split
along a later dimension reads its row band piece by piece and keeps its columns). Stacked experts
come from one HF tensor per expert, so a block of experts reads only those experts' tensors. The
stored bytes are those `load_hf_checkpoint` returns, bit for bit: F8 / FP4 / E8M0 / bf16 / f32 are
viewed as the same storage dtypes, `attn.wo_a` is dequantised (whole: it is small) exactly as
`ParamAssembler` does, and with `bf16_as_f32` bf16 leaves are widened to f32 (exact) as
`ced_jax.api` does on CPU. Parameters not named in `shardings` (e.g. the Engram tables, which stay
in host memory) are returned as numpy arrays read the `hf_loader` way.

Validation is `load_hf_checkpoint`'s (config.json, index, every shard header) and happens before any
tensor data is read. Memory: the host buffers of one parameter at a time (the blocks of this
process's devices; a block shared by several devices, e.g. a replicated one, is read once), plus one
read piece of at most `piece_bytes`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ced_jax.checkpoint.hf_loader import (
    CheckpointError,
    LoadReport,
    Shard,
    _check_config,
    _read_header,
    _resolve_include,
    check_shard_header,
    classify_tensors,
    read_index_json,
)
from ced_jax.checkpoint.mapping import ITEMSIZE, STORAGE_DTYPES, hf_inventory, our_param_specs, our_target
from ced_jax.config import ModelConfig
from pallas_kernels.formats import np_dequant_fp8_weight

PIECE_BYTES = 64 << 20  # largest single read of a block split along a later dimension


@dataclass(frozen=True)
class _Tensor:
    """One HF tensor in its shard file: absolute byte offset of its data, stored dtype and shape."""

    name: str
    path: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]


class _Files:
    """Open shard files, read with os.pread (no shared file position, no mmap: the page cache does
    not count towards our resident set)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read_into(self, t: _Tensor, start: int, out: memoryview) -> None:
        fd = self._fds.get(t.path)
        if fd is None:
            fd = self._fds[t.path] = os.open(t.path, os.O_RDONLY)
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], t.offset + start + done)
            if n <= 0:
                raise CheckpointError(f"{t.path}: tensor '{t.name}' ends past the end of the file")
            done += n
        self.bytes_read += done


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device block's index (a tuple of slices, as jax gives it) -> (start, stop) per dimension."""
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"block index {index} has a step; contiguous blocks only")
        out.append((start, stop))
    return tuple(out)


def _read_block(files: _Files, t: _Tensor, bounds, out: np.ndarray, piece_bytes: int) -> None:
    """Fill `out` (the block `bounds` of tensor `t`, in out's dtype) from the file: the rows
    [r0, r1) of the leading dimension are one byte range; read whole when the block spans every
    later dimension and needs no cast, else piece by piece (at most `piece_bytes` a piece)."""
    storage = STORAGE_DTYPES[t.dtype]
    (r0, r1), rest = bounds[0], bounds[1:]
    row_shape = t.shape[1:]
    row_bytes = math.prod(row_shape) * ITEMSIZE[t.dtype]
    full_rows = all(a == 0 and b == n for (a, b), n in zip(rest, row_shape, strict=True))
    if full_rows and out.dtype == storage and out.flags.c_contiguous:
        files.read_into(t, r0 * row_bytes, memoryview(out.reshape(-1).view(np.uint8)))
        return
    cols = tuple(slice(a, b) for a, b in rest)
    step = max(1, piece_bytes // max(row_bytes, 1))
    for c0 in range(r0, r1, step):
        c1 = min(r1, c0 + step)
        buf = np.empty((c1 - c0) * row_bytes, np.uint8)
        files.read_into(t, c0 * row_bytes, memoryview(buf))
        piece = buf.view(storage).reshape((c1 - c0, *row_shape))
        out[c0 - r0 : c1 - r0] = piece[(slice(None), *cols)]  # a bf16 -> f32 cast is exact


@dataclass
class _Param:
    """Our parameter and the HF tensors behind it: kind "copy" (one), "stack" (one per expert, in
    expert order), "wo_a" (weight, scale)."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype  # storage dtype of our param (before any widening)
    tensors: list[_Tensor]


def _param_sources(
    directory: Path, cfg: ModelConfig, groups: tuple[str, ...], by_shard: dict[str, list[str]], inventory
) -> dict[str, _Param]:
    specs = our_param_specs(cfg, groups)
    params: dict[str, _Param] = {}
    experts: dict[str, dict[int, _Tensor]] = {}
    wo_a: dict[str, dict[str, _Tensor]] = {}
    for file, names in by_shard.items():
        path = directory / file
        start, header = _read_header(path)
        for name in names:
            spec = inventory[name]
            if spec.group not in groups:
                continue
            lo, hi = header[name]["data_offsets"]
            if hi - lo != spec.nbytes:
                raise CheckpointError(
                    f"{path}: tensor '{name}' has {hi - lo} bytes for {spec.dtype} {list(spec.shape)}"
                )
            t = _Tensor(name, path, start + lo, spec.dtype, spec.shape)
            target = our_target(name)
            if target.kind == "copy":
                params[target.path] = _Param(target.path, "copy", *specs[target.path], [t])
            elif target.kind == "stack":
                experts.setdefault(target.path, {})[target.expert] = t
            else:
                wo_a.setdefault(target.path, {})["weight" if target.kind == "wo_a" else "scale"] = t
    for path, by_expert in experts.items():
        shape, dtype = specs[path]
        if sorted(by_expert) != list(range(shape[0])):
            raise CheckpointError(f"incomplete parameters: {path} (experts {len(by_expert)} of {shape[0]})")
        params[path] = _Param(path, "stack", shape, dtype, [by_expert[e] for e in range(shape[0])])
    for path, pair in wo_a.items():
        if len(pair) != 2:
            raise CheckpointError(f"incomplete parameters: {path} needs its weight and scale")
        params[path] = _Param(path, "wo_a", *specs[path], [pair["weight"], pair["scale"]])
    missing = sorted(set(specs) - set(params))
    if missing:
        raise CheckpointError(f"incomplete parameters: missing {missing[:10]}")
    return params


def _whole(files: _Files, t: _Tensor) -> np.ndarray:
    out = np.empty(t.shape, STORAGE_DTYPES[t.dtype])
    _read_block(files, t, _bounds((), t.shape), out, PIECE_BYTES)
    return out


def _host_value(files: _Files, p: _Param, cfg: ModelConfig) -> np.ndarray:
    """The whole parameter in host memory, as `ParamAssembler` builds it."""
    if p.kind == "wo_a":
        weight, scale = (_whole(files, t) for t in p.tensors)
        w = np_dequant_fp8_weight(weight, scale, cfg.weight_block_size)
        return w.astype(ml_dtypes.bfloat16)
    if p.kind == "copy":
        return _whole(files, p.tensors[0])
    out = np.empty(p.shape, p.dtype)
    for e, t in enumerate(p.tensors):
        _read_block(files, t, _bounds((), t.shape), out[e], PIECE_BYTES)
    return out


def _place(files: _Files, p: _Param, cfg: ModelConfig, sharding, dtype: np.dtype, piece_bytes: int):
    """One parameter as a global jax.Array laid out by `sharding`, reading only this process's blocks."""
    import jax

    indices = sharding.addressable_devices_indices_map(p.shape)
    uses: dict[tuple, int] = {}
    for index in indices.values():
        key = _bounds(index, p.shape)
        uses[key] = uses.get(key, 0) + 1
    cache: dict[tuple, np.ndarray] = {}
    whole: list[np.ndarray] = []  # wo_a: dequantised once for all blocks

    def block(index) -> np.ndarray:
        key = _bounds(index, p.shape)
        arr = cache.get(key)
        if arr is None:
            shape = tuple(b - a for a, b in key)
            if p.kind == "wo_a":
                if not whole:
                    whole.append(_host_value(files, p, cfg))
                arr = whole[0][tuple(slice(a, b) for a, b in key)].astype(dtype)  # a copy
            elif p.kind == "copy":
                arr = np.empty(shape, dtype)
                _read_block(files, p.tensors[0], key, arr, piece_bytes)
            else:
                arr = np.empty(shape, dtype)
                (e0, e1), rest = key[0], key[1:]
                for e in range(e0, e1):
                    _read_block(files, p.tensors[e], rest, arr[e - e0], piece_bytes)
        uses[key] -= 1
        if uses[key] > 0:
            cache[key] = arr
        else:
            cache.pop(key, None)
        return arr

    return jax.make_array_from_callback(p.shape, sharding, block, dtype=dtype)


def load_hf_onto_mesh(
    directory: str | Path,
    cfg: ModelConfig,
    shardings: Mapping[str, object],
    *,
    include: Iterable[str] = ("text",),
    bf16_as_f32: bool = False,
    piece_bytes: int = PIECE_BYTES,
) -> tuple[dict[str, object], LoadReport]:
    """Validate and read a checkpoint: {our path: jax.Array} for every path in `shardings` (flat
    path -> jax.sharding.Sharding), numpy (as `load_hf_checkpoint` gives it) for the others.
    `include` as for `load_hf_checkpoint`; `bf16_as_f32` widens the bf16 parameters placed on
    devices to f32. A path in `shardings` that the included groups do not hold is a ValueError."""
    directory = Path(directory)
    groups = _resolve_include(include, cfg)
    report = LoadReport(str(directory))
    _check_config(directory, cfg, report)
    weight_map = read_index_json(directory)["weight_map"]
    inventory = hf_inventory(cfg)
    by_shard = classify_tensors(weight_map, inventory, groups, report)
    report.shards = sorted(set(weight_map.values()))
    for file in report.shards:
        with Shard(directory, file) as shard:
            check_shard_header(shard, by_shard.get(file, []), inventory)
    sources = _param_sources(directory, cfg, groups, by_shard, inventory)
    unknown = sorted(set(shardings) - set(sources))
    if unknown:
        raise ValueError(f"shardings: paths the checkpoint's included groups do not hold: {unknown[:5]}")

    out: dict[str, object] = {}
    files = _Files()
    try:
        for path, p in sources.items():
            if path in shardings:
                dtype = p.dtype
                if bf16_as_f32 and dtype == np.dtype(ml_dtypes.bfloat16):
                    dtype = np.dtype(np.float32)
                out[path] = _place(files, p, cfg, shardings[path], dtype, piece_bytes)
            else:
                out[path] = _host_value(files, p, cfg)
            for t in p.tensors:
                report.tensors_read += 1
                if our_target(t.name).kind == "wo_a_scale":
                    report.consumed.append(t.name)
    finally:
        files.close()
    report.bytes_read = files.bytes_read  # what this process read (its blocks), not the tensors' size
    return out, report


__all__ = ["PIECE_BYTES", "load_hf_onto_mesh"]
