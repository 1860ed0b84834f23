"""What identifies a model's weights, byte for byte: the KV disk tier keeps pages across processes,
and a page is only valid under the exact weights that wrote it.

- A checkpoint directory (released HF layout or a `convert_weights` output): SHA-256 of every file
  under it, combined with the relative paths and sizes. Hashing hundreds of GB takes minutes, so the
  per-file hashes are cached in `DIGEST_CACHE_NAME` beside the files (or, where the directory is not
  writable, under the user's cache directory), keyed by each file's size and mtime: a file that
  changed is hashed again, the others are not.
- Weights held only in memory (the embedded presets, a `Model` built from arrays): every array's
  name, shape, dtype and bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

DIGEST_CACHE_NAME = ".ced_weights_digest.json"
_CACHE_FORMAT = 1
_PERSON = b"ced-weights"


def directory_digest(directory: str | os.PathLike) -> bytes:
    """16 bytes over every file under `directory` but hidden ones."""
    directory = Path(directory).resolve()
    files = sorted(  # hidden entries (.git, .cache of a hub download, this cache) are not weights
        rel
        for rel in (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
        if not any(part.startswith(".") for part in rel.split("/"))
    )
    cached = _read_cache(directory)
    entries, changed = {}, False
    for rel in files:
        st = (directory / rel).stat()
        old = cached.get(rel)
        if old is not None and old["bytes"] == st.st_size and old["mtime_ns"] == st.st_mtime_ns:
            entries[rel] = old
            continue
        sha = file_sha256(directory / rel)
        entries[rel] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        changed = True
    if changed or set(entries) != set(cached):
        _write_cache(directory, entries)
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for rel in files:
        h.update(f"{rel}\0{entries[rel]['bytes']}\0{entries[rel]['sha256']}\n".encode())
    return h.digest()


def arrays_digest(named_arrays: Iterable[tuple[str, np.ndarray]]) -> bytes:
    """16 bytes over (name, shape, dtype, bytes) of every array, in the order given."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for name, arr in named_arrays:
        arr = np.ascontiguousarray(arr)
        h.update(f"{name}:{arr.shape}:{arr.dtype};".encode())
        h.update(arr.view(np.uint8).reshape(-1).data if arr.size else b"")
    return h.digest()


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _cache_paths(directory: Path) -> list[Path]:
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ced-jax" / "weights"
    key = hashlib.sha256(str(directory).encode()).hexdigest()[:32]
    return [directory / DIGEST_CACHE_NAME, user / f"{key}.json"]


def _read_cache(directory: Path) -> dict:
    for path in _cache_paths(directory):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        ours = isinstance(data, dict) and data.get("format") == _CACHE_FORMAT
        if ours and data.get("directory") == str(directory):
            files = data.get("files")
            if isinstance(files, dict) and all(
                isinstance(v, dict) and {"bytes", "mtime_ns", "sha256"} <= set(v) for v in files.values()
            ):
                return files
    return {}


def _write_cache(directory: Path, entries: dict) -> None:
    text = json.dumps({"format": _CACHE_FORMAT, "directory": str(directory), "files": entries}, indent=1)
    for path in _cache_paths(directory):
        temp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp.write_text(text)
            os.replace(temp, path)
            return
        except OSError:
            try:
                temp.unlink()
            except OSError:
                pass
    # neither place is writable: the next start hashes again (correct, only slower)
