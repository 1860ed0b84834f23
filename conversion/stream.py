"""Reading a safetensors shard front to back with plain `read` calls (not mmap, so the page cache does
not count towards our RSS; safetensors' numpy reader cannot produce F8 anyway), each tensor straight
into its destination and each byte hashed once for the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from conversion.options import ConversionError

READ_PIECE = 64 << 20  # bytes per read call: progress granularity and hashing in step with reads


class StreamReader:
    """One shard read front to back: header, then tensors in file order, every byte hashed once."""

    def __init__(self, path: Path, progress) -> None:
        self.path = path
        self.progress = progress
        self.sha = hashlib.sha256()
        self.fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        self.pos = 0
        (n,) = struct.unpack("<Q", self._read(8))
        header = json.loads(self._read(n))
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        # (name, begin, end), absolute offsets, in file order
        self.entries = sorted(
            (
                (k, self.data_start + v["data_offsets"][0], self.data_start + v["data_offsets"][1])
                for k, v in header.items()
            ),
            key=lambda e: e[1],
        )

    def close(self) -> None:
        self.fh.close()

    def _readinto(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            got = self.fh.readinto(view[done : done + READ_PIECE])
            if not got:
                raise ConversionError(
                    f"{self.path}: file ends at byte {self.pos + done}, expected at least "
                    f"{self.pos + len(view)} (truncated?)"
                )
            self.sha.update(view[done : done + got])
            done += got
            self.progress.update(got)
        self.pos += len(view)

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self._readinto(memoryview(buf))
        return bytes(buf)

    def skip_to(self, offset: int) -> None:
        """Read (and hash) up to `offset`: ignored tensors, gaps."""
        if offset < self.pos:
            raise ConversionError(f"{self.path}: overlapping tensor data at byte {offset}")
        scratch = np.empty(min(READ_PIECE, max(offset - self.pos, 1)), np.uint8)
        while self.pos < offset:
            n = min(len(scratch), offset - self.pos)
            self._readinto(memoryview(scratch)[:n])

    def read_into(self, name: str, begin: int, end: int, dest: np.ndarray) -> None:
        self.skip_to(begin)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        if len(view) != end - begin:
            raise ConversionError(
                f"{self.path}: tensor '{name}' holds {end - begin} bytes, expected {len(view)}"
            )
        self._readinto(view)

    def finish(self) -> str:
        size = os.fstat(self.fh.fileno()).st_size
        self.skip_to(size)
        return self.sha.hexdigest()
