"""Image parts of HTTP requests: found in each API's body, resolved to bytes, checked, and leased.

The three ways users send images (seeds): a link (fetched only when the server allows it,
serving/image_fetch.py), base64 (a `data:` URL, OpenAI `file_data`, or an Anthropic base64 source), and a
Files API id (serving/files.py). The forms by API:

- Chat Completions: `{"type": "image_url", "image_url": {"url": "https://..." | "data:image/png;base64,...",
  "detail": ...}}` (`detail` is accepted and ignored: the engine's pre-processing decides the resolution),
  and `{"type": "file", "file": {"file_id": ...} | {"file_data": ...}}`.
- Responses: `{"type": "input_image", "image_url": ... | "file_id": ...}` and `input_file` with
  `file_id` / `file_data`.
- Anthropic Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"} |
  {"type": "url", "url"} | {"type": "file", "file_id"}}`, also inside `tool_result` content.

`extract_images` walks the body (before deepseek-recipe converts it), records each image with the field
that names it (`messages[0].content[1]`), and rewrites the part into one form the library converts for
every API: an image URL `https://ced-image.invalid/N` (`.invalid` is reserved and never fetched; the
library does not fetch at conversion either). After rendering, each placeholder's source URL gives N
back, so the images reach the engine in prompt order whatever form they came in. `ImageResolver` turns a
reference into bytes: base64 decoded strictly, the type recognised from the content (PNG, JPEG, WebP, GIF)
and checked against a declared media type, files leased for the request's life, URLs fetched under the
fetch limits. Every refusal is a 400 naming the field and the problem.

Identical images in one request are kept once (the same bytes object, by SHA-256); across requests the
engine's feature cache is keyed by the decoded pixels' hash, so a repeated image skips the ViT whatever
way it arrives.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import re
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from serving.files import FileError, FileLease, FileStore, sniff_image_type
from serving.http.errors import ApiError
from serving.image_fetch import ImageFetcher, ImageFetchRefused, ImageInputConfig
from serving.work_pools import FairPool, current_tenant

CANONICAL_URL = "https://ced-image.invalid/"
# Media types an Anthropic base64 source may declare (Anthropic's own list).
ANTHROPIC_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_DATA_URL = re.compile(r"^data:([^,;]*)((?:;[^,;]*)*),", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image part of a request, before its bytes are fetched."""

    field: str  # the request field that holds it, e.g. messages[0].content[1]
    kind: str  # "data" (base64), "url" or "file"
    value: str  # the data URL / base64 text, the URL, or the file id
    media_type: str | None = None  # a declared type (Anthropic media_type); data URLs declare their own


# ---------------------------------------------------------------------------------------------------------
# Finding the image parts (and rewriting them into the one form the converter gets)
# ---------------------------------------------------------------------------------------------------------


def extract_images(api: str, body: dict) -> list[ImageRef]:
    """The request's image parts in body order; rewrites each into `CANONICAL_URL + index` in place.

    `api`: "chat", "responses" or "messages" (serving/http/convert.py). Malformed image parts are a 400
    naming the field."""
    refs: list[ImageRef] = []
    if api == "chat":
        for i, msg in _items(body.get("messages")):
            _walk_openai_parts(msg.get("content"), f"messages[{i}].content", refs)
    elif api == "responses":
        for i, item in _items(body.get("input")):
            _walk_responses_parts(item.get("content"), f"input[{i}].content", refs)
    elif api == "messages":
        for i, msg in _items(body.get("messages")):
            _walk_anthropic_blocks(msg.get("content"), f"messages[{i}].content", refs)
    return refs


def _items(value: Any):
    if isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, dict):
                yield i, v


def _add(refs: list[ImageRef], ref: ImageRef) -> str:
    refs.append(ref)
    return f"{CANONICAL_URL}{len(refs) - 1}"


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{field}: expected a non-empty string", param=field)
    return value


def _url_ref(url: Any, field: str) -> ImageRef:
    """An OpenAI-style image URL: `data:` (base64) or http(s)."""
    url = _string(url, field)
    if url.startswith("data:"):
        return ImageRef(field, "data", url)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return ImageRef(field, "url", url)
    raise ApiError(
        400,
        f"{field}: expected an http(s) URL or a data: URL with base64 image data, got "
        f"{'scheme ' + repr(scheme) if scheme else 'no URL scheme'}",
        param=field,
    )


def _file_data_ref(data: Any, field: str) -> ImageRef:
    data = _string(data, field)
    return ImageRef(field, "data", data if data.startswith("data:") else f"data:;base64,{data}")


def _walk_openai_parts(content: Any, field: str, refs: list[ImageRef]) -> None:
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        where = f"{field}[{j}]"
        kind = part.get("type")
        if kind == "image_url":
            image_url = part.get("image_url")
            if isinstance(image_url, dict):
                ref = _url_ref(image_url.get("url"), f"{where}.image_url.url")
            else:
                ref = _url_ref(image_url, f"{where}.image_url")
        elif kind == "file":
            f = part.get("file")
            if not isinstance(f, dict):
                raise ApiError(
                    400, f"{where}.file: expected an object with file_id or file_data", param=where
                )
            if f.get("file_id") is not None:
                ref = ImageRef(
                    f"{where}.file.file_id", "file", _string(f["file_id"], f"{where}.file.file_id")
                )
            elif f.get("file_data") is not None:
                ref = _file_data_ref(f["file_data"], f"{where}.file.file_data")
            else:
                raise ApiError(400, f"{where}.file: needs file_id or file_data", param=f"{where}.file")
        else:
            continue
        content[j] = {"type": "image_url", "image_url": {"url": _add(refs, ref)}}


def _walk_responses_parts(content: Any, field: str, refs: list[ImageRef]) -> None:
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_image", "input_file"):
            continue
        where = f"{field}[{j}]"
        if part.get("file_id") is not None:
            ref = ImageRef(f"{where}.file_id", "file", _string(part["file_id"], f"{where}.file_id"))
        elif part.get("type") == "input_image" and part.get("image_url") is not None:
            ref = _url_ref(part["image_url"], f"{where}.image_url")
        elif part.get("type") == "input_file" and part.get("file_data") is not None:
            ref = _file_data_ref(part["file_data"], f"{where}.file_data")
        else:
            need = "image_url or file_id" if part.get("type") == "input_image" else "file_id or file_data"
            raise ApiError(400, f"{where}: needs {need}", param=where)
        content[j] = {"type": "input_image", "image_url": _add(refs, ref), "detail": "auto"}


def _walk_anthropic_blocks(content: Any, field: str, refs: list[ImageRef]) -> None:
    if not isinstance(content, list):
        return
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        where = f"{field}[{j}]"
        if block.get("type") == "tool_result":
            _walk_anthropic_blocks(block.get("content"), f"{where}.content", refs)
            continue
        if block.get("type") != "image":
            continue
        source = block.get("source")
        if not isinstance(source, dict):
            raise ApiError(400, f"{where}.source: expected an object", param=f"{where}.source")
        kind = source.get("type")
        if kind == "base64":
            media = source.get("media_type")
            if media not in ANTHROPIC_MEDIA_TYPES:
                raise ApiError(
                    400,
                    f"{where}.source.media_type: expected one of {', '.join(ANTHROPIC_MEDIA_TYPES)}, got "
                    f"{media!r}",
                    param=f"{where}.source.media_type",
                )
            data = _string(source.get("data"), f"{where}.source.data")
            ref = ImageRef(f"{where}.source.data", "data", f"data:;base64,{data}", media_type=media)
        elif kind == "url":
            ref = _url_ref(source.get("url"), f"{where}.source.url")
            if ref.kind != "url":
                raise ApiError(400, f"{ref.field}: expected an http(s) URL", param=ref.field)
        elif kind == "file":
            ref = ImageRef(
                f"{where}.source.file_id", "file", _string(source.get("file_id"), f"{where}.source.file_id")
            )
        else:
            raise ApiError(
                400,
                f"{where}.source.type: expected 'base64', 'url' or 'file', got {kind!r}",
                param=f"{where}.source.type",
            )
        content[j] = {"type": "image", "source": {"type": "url", "url": _add(refs, ref)}}


def index_of(source_url: str | None) -> int | None:
    """N for a rewritten image's URL `CANONICAL_URL + N`; None for any other URL."""
    if isinstance(source_url, str) and source_url.startswith(CANONICAL_URL):
        tail = source_url.removeprefix(CANONICAL_URL)
        if tail.isdigit():
            return int(tail)
    return None


# ---------------------------------------------------------------------------------------------------------
# Resolving references to bytes
# ---------------------------------------------------------------------------------------------------------


class ImageResolver:
    """Bytes for image references: base64 decoded, files leased, URLs fetched; each checked."""

    def __init__(
        self,
        files: FileStore,
        fetcher: ImageFetcher,
        limits: ImageInputConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        fetch_pool: FairPool | None = None,
    ):
        """`fetch_pool`: URLs are downloaded there, for the tenant of the calling `prepare` job
        (None: on the calling thread)."""
        self.files = files
        self.fetcher = fetcher
        self.fetch_pool = fetch_pool
        self.limits = limits or ImageInputConfig()
        self._counted = Counter(
            "ced_http_images",
            "Images in HTTP requests by source (data: base64, file: Files API, url: fetched) and outcome.",
            ["source", "outcome"],
            registry=registry if registry is not None else CollectorRegistry(),
        )

    def precheck(self, refs: list[ImageRef]) -> None:
        """Refusals that need no I/O: too many images, URL fetching off / host not allowed."""
        limit = self.limits.max_images_per_request
        if len(refs) > limit:
            field = refs[limit].field
            raise ApiError(
                400,
                f"{field}: too many images in one request ({len(refs)}); this server accepts at most {limit}",
                param=field,
            )
        for ref in refs:
            if ref.kind == "url":
                try:
                    self.fetcher.check(ref.value)
                except ImageFetchRefused as e:
                    raise ApiError(400, f"{ref.field}: {e}", param=ref.field) from None

    def resolve(self, refs: list[ImageRef], identity: str, leases: list[FileLease]) -> list[bytes]:
        """The images' bytes in the order of `refs`; file leases are appended to `leases` (the caller
        releases them when the request ends, also when this raises)."""
        seen: dict[str, bytes] = {}
        out = []
        for ref in refs:
            try:
                data, declared = self._bytes(ref, identity, leases)
                self._check(ref, data, declared)
            except ApiError:
                self._counted.labels(ref.kind, "refused").inc()
                raise
            self._counted.labels(ref.kind, "accepted").inc()
            out.append(seen.setdefault(hashlib.sha256(data).hexdigest(), data))
        return out

    def _bytes(self, ref: ImageRef, identity: str, leases: list[FileLease]) -> tuple[bytes, str | None]:
        """(bytes, the media type the request declared for them, if any)."""
        if ref.kind == "file":
            try:
                lease = self.files.acquire(identity, ref.value, ref.field)
            except FileError as e:
                raise ApiError(400, e.message, param=ref.field) from None
            leases.append(lease)
            return lease.data, None
        if ref.kind == "url":
            try:
                if self.fetch_pool is None:
                    return self.fetcher.fetch(ref.value), None
                return self.fetch_pool.call(current_tenant() or "", self.fetcher.fetch, ref.value), None
            except ImageFetchRefused as e:
                raise ApiError(400, f"{ref.field}: {e}", param=ref.field) from None
        return self._decode_data_url(ref)

    def _decode_data_url(self, ref: ImageRef) -> tuple[bytes, str | None]:
        m = _DATA_URL.match(ref.value)
        if m is None:
            raise ApiError(
                400, f"{ref.field}: malformed data URL (expected data:<type>;base64,<data>)", param=ref.field
            )
        params = [p.strip().lower() for p in m.group(2).split(";") if p.strip()]
        if "base64" not in params:
            raise ApiError(
                400, f"{ref.field}: the data URL must be base64-encoded (;base64,)", param=ref.field
            )
        declared = m.group(1).strip().lower()
        if declared and not declared.startswith("image/"):
            raise ApiError(
                400,
                f"{ref.field}: the data URL's media type {declared!r} is not an image type",
                param=ref.field,
            )
        payload = ref.value[m.end() :]
        limit = self.limits.max_image_bytes
        if len(payload) // 4 * 3 > limit + 3:
            raise ApiError(
                400,
                f"{ref.field}: the image is about {len(payload) // 4 * 3} bytes; this server accepts images "
                f"up to {limit} bytes",
                param=ref.field,
            )
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"{ref.field}: invalid base64 data ({e})", param=ref.field) from None
        return data, ref.media_type or declared or None

    def _check(self, ref: ImageRef, data: bytes, declared: str | None) -> None:
        limit = self.limits.max_image_bytes
        if len(data) == 0:
            raise ApiError(400, f"{ref.field}: the image is empty", param=ref.field)
        if len(data) > limit:
            raise ApiError(
                400,
                f"{ref.field}: the image is {len(data)} bytes; this server accepts up to {limit}",
                param=ref.field,
            )
        actual = sniff_image_type(data)
        if actual is None:
            raise ApiError(
                400, f"{ref.field}: is not an image (expected PNG, JPEG, WebP or GIF data)", param=ref.field
            )
        if declared and declared != actual:
            raise ApiError(
                400,
                f"{ref.field}: the media type is declared as {declared} but the data is {actual}",
                param=ref.field,
            )
