"""The Files API's store: uploaded images per identity, deduplicated by SHA-256, with TTLs and leases.

The seeds' design for the Files API path (upload first, then reference): a resource table that registers a
file on upload with its id, hash and TTL, and reference counts so that no file leaks. Here:

- Bytes live in memory (no disk directory to configure or clean up), content-addressed: a blob per distinct
  SHA-256, shared by every file record with that content (the same image uploaded twice, by one identity or
  by several, is stored once). Quotas count what each identity uploaded, deduplicated or not: an identity
  may hold `FilesConfig.max_bytes_per_identity` bytes of files and all identities together
  `max_total_bytes` (so whether an upload fits never tells one tenant what another uploaded; the memory
  held, each blob once, is at most that). An upload that would pass either is refused (413; the store
  never evicts a live file to make room).
- A file belongs to the identity that uploaded it (an API key's name; serving/tenants.py): every lookup
  takes the identity, and another identity's file id answers "no such file", the same as an unknown id.
- Each file expires `ttl_s` after upload (a shorter `expires_after` may be asked for). An expired or deleted
  file is gone for lookups at once (404), but a request that holds a `FileLease` on it keeps its bytes until
  the lease is released: a DELETE while a request using the file runs does not break that request. The
  record and, with its last record, the blob are dropped when the file is gone and no lease is left; so once
  requests finish and files are deleted or expired the store holds zero bytes (`stored_bytes`).
- Only images are stored (PNG, JPEG, WebP, GIF), recognised by their content, not by the file name or the
  declared content type: this server's files exist to be referenced as image input.

Thread-safe: uploads and lookups come from the event loop, leases from request-conversion threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
import threading
import time
from collections.abc import Callable

from serving.flags import IMAGES, flag, named

MIB = 1024 * 1024

# Purposes of OpenAI's Files API that name image input; the others (batch, fine-tune, evals) are jobs this
# server does not run, refused naming what is accepted.
IMAGE_PURPOSES = ("vision", "user_data", "assistants")


@dataclasses.dataclass(frozen=True)
class FilesConfig:
    """Limits of the Files API (`ced-jax serve --files-*`)."""

    max_file_bytes: int = flag(20 * MIB, "--files-max-file-bytes", "Files API: one upload", group=IMAGES)
    max_total_bytes: int = flag(
        512 * MIB,
        "--files-max-total-bytes",
        "Files API: bytes of files held for all identities together (in memory)",
        group=IMAGES,
    )
    max_bytes_per_identity: int = flag(
        128 * MIB,
        "--files-max-bytes-per-identity",
        "Files API: bytes of files one identity (API key) may hold",
        group=IMAGES,
    )  # deduplicated or not
    max_files_per_identity: int = flag(1000, "--files-max-per-identity", "Files API: files", group=IMAGES)
    # A file's lifetime after upload (hosted Files APIs keep files longer; a local server's memory is the
    # budget, and the seeds' table has a TTL per file).
    ttl_s: float = flag(3600.0, "--files-ttl", "Files API: seconds a file lives after upload", group=IMAGES)

    def __post_init__(self):
        for name in ("max_file_bytes", "max_total_bytes", "max_bytes_per_identity", "max_files_per_identity"):
            if getattr(self, name) < 1:
                raise ValueError(f"FilesConfig.{named(self, name)}: must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(
                f"FilesConfig.{named(self, 'ttl_s')}: must be a finite number > 0, got {self.ttl_s}"
            )
        for limit in ("max_total_bytes", "max_bytes_per_identity"):
            if self.max_file_bytes > getattr(self, limit):
                raise ValueError(
                    f"FilesConfig.{named(self, 'max_file_bytes')} {self.max_file_bytes}: exceeds "
                    f"{named(self, limit)} {getattr(self, limit)}"
                )


class FileError(ValueError):
    """A refused upload or an unknown file; `status` is the HTTP status, `field` the request field."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.status = status
        self.field = field
        self.message = f"{field}: {message}"


def sniff_image_type(data: bytes) -> str | None:
    """The MIME type of an image by its leading bytes (PNG, JPEG, WebP, GIF); None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


@dataclasses.dataclass
class StoredFile:
    """One file record (what the API lists); the bytes are in the store's blob for `sha256`."""

    id: str
    identity: str
    filename: str
    purpose: str
    mime_type: str
    sha256: str
    size: int
    created_at: int  # unix seconds
    expires_at: int  # unix seconds
    leases: int = 0
    deleted: bool = False


@dataclasses.dataclass
class _Blob:
    data: bytes
    records: int  # file records (live, or gone but leased) that point here


class FileLease:
    """A request's hold on a file's bytes: from `FileStore.acquire`, given back by `release` (idempotent)."""

    def __init__(self, store: FileStore, record: StoredFile, data: bytes):
        self._store = store
        self.record = record
        self.data = data
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store._release(self.record)


class FileStore:
    """Uploaded files per identity (see the module docstring). `clock`: unix seconds (tests pass a fake)."""

    def __init__(self, config: FilesConfig | None = None, *, clock: Callable[[], float] = time.time):
        self.config = config or FilesConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}
        self._blobs: dict[str, _Blob] = {}

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def stored_bytes(self) -> int:
        """Distinct bytes held (each blob once, however many files share it)."""
        with self._lock:
            self._sweep()
            return sum(len(b.data) for b in self._blobs.values())

    @property
    def record_count(self) -> int:
        """File records held, including gone ones still leased by a running request."""
        with self._lock:
            self._sweep()
            return len(self._files)

    # ---- the API ---------------------------------------------------------------------------------
    def upload(
        self,
        identity: str,
        data: bytes,
        *,
        filename: str,
        purpose: str,
        expires_after_s: float | None = None,
    ) -> StoredFile:
        """Stores an image; FileError (400, or 413 for size) naming the field when refused."""
        cfg = self.config
        if len(data) == 0:
            raise FileError(400, "file", "is empty")
        if len(data) > cfg.max_file_bytes:
            raise FileError(
                413,
                "file",
                f"is {len(data)} bytes; this server accepts files up to {cfg.max_file_bytes} bytes",
            )
        mime = sniff_image_type(data)
        if mime is None:
            raise FileError(
                400,
                "file",
                "is not an image this server accepts (PNG, JPEG, WebP or GIF, recognised by content; the "
                "file name and declared type are not trusted)",
            )
        ttl = cfg.ttl_s if expires_after_s is None else min(cfg.ttl_s, expires_after_s)
        if not ttl > 0:
            raise FileError(
                400, "expires_after", f"must be a positive number of seconds, got {expires_after_s}"
            )
        sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            self._sweep()
            mine = [f for f in self._files.values() if f.identity == identity and self._live(f)]
            if len(mine) >= cfg.max_files_per_identity:
                raise FileError(
                    400,
                    "file",
                    f"this identity already holds {len(mine)} files, the server's limit; delete some first",
                )
            my_bytes = sum(f.size for f in mine)
            if my_bytes + len(data) > cfg.max_bytes_per_identity:
                raise FileError(
                    413,
                    "file",
                    f"this identity holds {my_bytes} bytes of files; with this one it would pass its quota "
                    f"of {cfg.max_bytes_per_identity} bytes; delete files or retry after some expire",
                )
            # Every record counts, leased ones included, deduplicated or not: the answer must not
            # depend on what other identities uploaded.
            held = sum(f.size for f in self._files.values())
            if held + len(data) > cfg.max_total_bytes:
                raise FileError(
                    413,
                    "file",
                    f"the server's file storage is full ({held} of {cfg.max_total_bytes} bytes held); "
                    "delete files or retry after some expire",
                )
            blob = self._blobs.get(sha)
            if blob is None:
                blob = self._blobs[sha] = _Blob(data=bytes(data), records=0)
            blob.records += 1
            now = self._clock()
            record = StoredFile(
                id=f"file-{secrets.token_hex(12)}",
                identity=identity,
                filename=filename,
                purpose=purpose,
                mime_type=mime,
                sha256=sha,
                size=len(data),
                created_at=int(now),
                expires_at=int(now + ttl),
            )
            self._files[record.id] = record
            return record

    def get(self, identity: str, file_id: str, field: str = "file_id") -> StoredFile:
        with self._lock:
            self._sweep()
            return self._find(identity, file_id, field)

    def content(self, identity: str, file_id: str) -> tuple[StoredFile, bytes]:
        with self._lock:
            self._sweep()
            record = self._find(identity, file_id, "file_id")
            return record, self._blobs[record.sha256].data

    def list(self, identity: str, purpose: str | None = None) -> list[StoredFile]:
        """The identity's live files, oldest first."""
        with self._lock:
            self._sweep()
            out = [
                f
                for f in self._files.values()
                if f.identity == identity and self._live(f) and (purpose is None or f.purpose == purpose)
            ]
        return sorted(out, key=lambda f: (f.created_at, f.id))

    def delete(self, identity: str, file_id: str) -> StoredFile:
        """Removes the file from the API at once; its bytes stay while a request holds a lease on it."""
        with self._lock:
            self._sweep()
            record = self._find(identity, file_id, "file_id")
            record.deleted = True
            self._sweep()
            return record

    def acquire(self, identity: str, file_id: str, field: str) -> FileLease:
        """A lease on the identity's file for one request (release it when the request ends)."""
        with self._lock:
            self._sweep()
            record = self._find(identity, file_id, field)
            record.leases += 1
            return FileLease(self, record, self._blobs[record.sha256].data)

    # ---- internals (hold the lock) ---------------------------------------------------------------
    def _live(self, f: StoredFile) -> bool:
        return not f.deleted and self._clock() < f.expires_at

    def _find(self, identity: str, file_id: str, field: str) -> StoredFile:
        f = self._files.get(file_id) if isinstance(file_id, str) else None
        if f is None or f.identity != identity or not self._live(f):
            # Another identity's file reads exactly like an unknown one: ids reveal nothing across tenants.
            raise FileError(404, field, f"no such file: {file_id!r} (unknown, deleted or expired)")
        return f

    def _release(self, record: StoredFile) -> None:
        with self._lock:
            record.leases -= 1
            self._sweep()

    def _sweep(self) -> None:
        """Drops gone (deleted or expired) records that no request holds, and blobs no record uses."""
        gone = [f for f in self._files.values() if f.leases == 0 and not self._live(f)]
        for f in gone:
            del self._files[f.id]
            blob = self._blobs[f.sha256]
            blob.records -= 1
            if blob.records == 0:
                del self._blobs[f.sha256]
