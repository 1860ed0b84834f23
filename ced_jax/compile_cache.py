"""JAX's persistent compilation cache, with every entry checked before it is loaded.

A second start of `serve`, `generate` or a notebook loads its compiled programs from disk instead of
compiling them again. JAX keys an entry by the program, the compile options, the JAX / XLA version,
the flags and the device kind, so a change to any of them is a miss (a new entry), never a stale hit.

JAX trusts what it reads: a truncated file fails to decompress (JAX warns and recompiles), but a
well-formed entry under another key's name (a swapped or copied file, a cache synchronised from a
machine with other programs) would be loaded and run as the wrong program. So each entry written
through `enable` carries a header with a digest of its key and bytes; an entry whose header does not
match is dropped with one warning naming it and compiled again (the new entry replaces it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import jax
from jax._src import compilation_cache as _jax_cache
from jax._src import config as _jax_config
from jax._src.compilation_cache_interface import CacheInterface

log = logging.getLogger("ced_jax.compile_cache")

_MAGIC = b"ced-jax-xla-cache-v1\n"
_DIGEST = hashlib.sha256().digest_size
_lock = threading.Lock()
_enabled_dir: Path | None = None


def default_cache_dir() -> Path:
    """`$JAX_COMPILATION_CACHE_DIR` when set (one cache for a process and every process it starts),
    else the platform's per-user cache directory: `$XDG_CACHE_HOME/ced-jax/xla` (`~/.cache/ced-jax/xla`)
    on Linux, `~/Library/Caches/ced-jax/xla` on macOS, `%LOCALAPPDATA%\\ced-jax\\xla` on Windows."""
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if env:
        return Path(env)
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ced-jax" / "xla"


def _digest(key: str, payload: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(key.encode())
    h.update(b"\0")
    h.update(payload)
    return h.digest()


class CheckedCache(CacheInterface):
    """JAX's file cache with a header (magic, sha256 of key and payload) on every entry."""

    def __init__(self, base: CacheInterface):
        self._base = base
        self.rejected: list[str] = []

    @property
    def _path(self):
        return self._base._path

    @_path.setter
    def _path(self, value):
        self._base._path = value

    def get(self, key: str) -> bytes | None:
        try:
            blob = self._base.get(key)
        except Exception as e:  # an unreadable file is a miss, as a corrupt one
            return self._reject(key, f"unreadable ({type(e).__name__}: {e})")
        if blob is None:
            return None
        head = len(_MAGIC) + _DIGEST
        if len(blob) < head or not blob.startswith(_MAGIC):
            return self._reject(key, "not a ced-jax entry, or truncated")
        payload = blob[head:]
        if blob[len(_MAGIC) : head] != _digest(key, payload):
            return self._reject(key, "its digest does not match its key and bytes (corrupt, or another's)")
        return payload

    def put(self, key: str, value: bytes) -> None:
        self._base.put(key, _MAGIC + _digest(key, value) + value)

    def clear(self):
        self._base.clear()

    def _reject(self, key: str, why: str) -> None:
        self.rejected.append(key)
        log.warning("compilation cache entry %s in %s: %s; compiling it again", key, self._path, why)
        # JAX's file cache never overwrites an entry: remove this one (ours by name: the key JAX asked
        # for) so that the fresh compile's entry takes its place.
        directory = Path(getattr(self._base, "path", self._path))
        for suffix in ("-cache", "-atime"):
            try:
                (directory / f"{key}{suffix}").unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("compilation cache entry %s: cannot remove it (%s)", key, e)
        return None


def enable(cache_dir: str | Path | None = None) -> Path:
    """Turns the checked persistent cache on for this process, in `cache_dir` (None:
    `default_cache_dir()`), and returns the directory. Every program is cached, however quick its
    compile, so a warm start compiles nothing. Enabling another directory later switches to it."""
    global _enabled_dir
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    with _lock:
        if _enabled_dir == path and isinstance(_jax_cache._cache, CheckedCache):
            return path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"compilation cache directory {path}: {e.strerror or e}") from None
        _jax_cache.reset_cache()
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        _jax_cache._initialize_cache()
        if _jax_cache._cache is None:
            raise RuntimeError(f"JAX did not open its compilation cache in {path}")
        _jax_cache._cache = CheckedCache(_jax_cache._cache)
        _enabled_dir = path
    log.info("compilation cache: %s", path)
    return path


def disable() -> None:
    """No persistent cache for this process: every program is compiled."""
    global _enabled_dir
    with _lock:
        _jax_cache.reset_cache()
        jax.config.update("jax_enable_compilation_cache", False)
        _enabled_dir = None


def configure(enabled: bool, cache_dir: str | Path | None = None) -> Path | None:
    """What the CLI flags and `ced_jax.load` ask for: off (`disable`), a directory (`enable`), or the
    default: the directory already in use in this process (turned on here, or set in JAX's own
    `jax_compilation_cache_dir`), else `default_cache_dir()`."""
    if not enabled:
        if cache_dir is not None:
            raise ValueError("a compilation cache directory was given with the cache turned off")
        disable()
        return None
    if cache_dir is None:
        if _enabled_dir is not None and isinstance(_jax_cache._cache, CheckedCache):
            return _enabled_dir
        cache_dir = _jax_config.compilation_cache_dir.value or None
    return enable(cache_dir)


def current_dir() -> Path | None:
    """The directory `enable` turned on, or None."""
    return _enabled_dir


def rejected_entries() -> list[str]:
    """Keys of the entries found corrupt or foreign in this process (each compiled again)."""
    cache = _jax_cache._cache
    return list(cache.rejected) if isinstance(cache, CheckedCache) else []


def cache_bytes(cache_dir: str | Path | None = None) -> tuple[int, int]:
    """(entries, bytes) of the cache directory (None: the enabled one)."""
    path = Path(cache_dir) if cache_dir is not None else _enabled_dir
    if path is None or not path.is_dir():
        return 0, 0
    files = [p for p in path.iterdir() if p.name.endswith("-cache")]
    return len(files), sum(p.stat().st_size for p in files)
