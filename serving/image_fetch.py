"""Fetching image URLs for image input: off by default, allow-listed hosts, byte and time limits.

Local deployments often have no outbound network, and a server that fetches any URL a client names is a
request-forgery tool against its own network; so URL images are refused unless `allow_image_urls` is on,
and then only from hosts named in `allowed_hosts` (exact host match, case-insensitive; an entry
`host:port` also pins the port), over http or https. The fetch reads at most `max_bytes` (a larger
Content-Length is refused before reading; a body without one is cut off when it passes the limit), within
`timeout_s` for the whole exchange (connect, redirects, every read), and follows at most `max_redirects`
redirects, each to an allowed host too. Every refusal is an `ImageFetchRefused` whose message says why
(the HTTP layer answers 400 naming the request field).

Why not the URL as a cache key: the content at a URL may change; the engine's feature cache is keyed by the
decoded image's content hash, whatever way the bytes arrived (seeds, issue 14).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import math
import socket
import ssl
import threading
import time
from urllib.parse import urljoin, urlsplit

from serving.flags import IMAGES, flag, named

MIB = 1024 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)
_READ_CHUNK = 64 * 1024


@dataclasses.dataclass(frozen=True)
class ImageInputConfig:
    """Per-request image limits of the HTTP API (`ced-jax serve --max-images-per-request N
    --max-image-bytes B`)."""

    max_images_per_request: int = 16
    max_image_bytes: int = 20 * MIB  # one image's decoded bytes

    def __post_init__(self):
        for name in ("max_images_per_request", "max_image_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageInputConfig.{name}: must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ImageFetchConfig:
    """`ced-jax serve --allow-image-urls HOST[,HOST...] --image-url-max-bytes B --image-url-timeout S`."""

    allow_image_urls: bool = False
    allowed_hosts: tuple[str, ...] = flag(
        (),
        "--allow-image-urls",
        "HTTP API: fetch image URLs from these hosts (host or host:port); default: URLs are refused",
        group=IMAGES,
        metavar="HOST[,HOST...]",
        parse=lambda hosts: tuple(h.strip() for h in hosts.split(",")),  # checked below
        also=(("allow_image_urls", True),),  # naming hosts turns fetching on
    )
    max_bytes: int = flag(20 * MIB, "--image-url-max-bytes", "one fetched image", group=IMAGES)
    timeout_s: float = flag(10.0, "--image-url-timeout", "seconds per fetch", group=IMAGES)
    max_redirects: int = 3

    def __post_init__(self):
        if self.max_bytes < 1:
            raise ValueError(
                f"ImageFetchConfig.{named(self, 'max_bytes')}: must be >= 1, got {self.max_bytes}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            timeout = named(self, "timeout_s")
            raise ValueError(f"ImageFetchConfig.{timeout}: must be a finite number > 0, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"ImageFetchConfig.max_redirects: must be >= 0, got {self.max_redirects}")
        for h in self.allowed_hosts:
            if not h or "/" in h or h != h.strip():
                hosts = named(self, "allowed_hosts")
                raise ValueError(f"ImageFetchConfig.{hosts}: {h!r} is not a host name (or host:port)")
        if self.allow_image_urls and not self.allowed_hosts:
            raise ValueError(
                f"ImageFetchConfig.{named(self, 'allowed_hosts')}: URL fetching is on but no host is "
                "allowed; name the hosts images may be fetched from"
            )


class ImageFetchRefused(ValueError):
    """A URL this server will not (or could not) fetch; the message says why."""


class ImageFetcher:
    """Fetches image bytes from allowed URLs (blocking; the HTTP layer calls it off the event loop)."""

    def __init__(self, config: ImageFetchConfig | None = None):
        self.config = config or ImageFetchConfig()
        self._hosts = {h.lower() for h in self.config.allowed_hosts}

    def check(self, url: str) -> None:
        """Refuses a URL without any network access (disabled, scheme, host); passes an allowed one."""
        if not self.config.allow_image_urls:
            raise ImageFetchRefused(
                "image URL fetching is disabled on this server; send the image as base64 (a data: URL) or "
                "upload it to /v1/files and reference its file id"
            )
        self._split(url)

    def fetch(self, url: str) -> bytes:
        """The body of an allowed URL (HTTP 200), within the byte and time limits."""
        self.check(url)
        deadline = time.monotonic() + self.config.timeout_s
        for _ in range(self.config.max_redirects + 1):
            try:
                status, location, body = self._get(url, deadline)
            except TimeoutError:
                raise ImageFetchRefused(
                    f"fetching the image URL took over {self.config.timeout_s:g} s, this server's limit"
                ) from None
            if status not in _REDIRECTS:
                if status != 200:
                    raise ImageFetchRefused(f"fetching the image URL answered HTTP {status}")
                return body
            if not location:
                raise ImageFetchRefused(f"fetching the image URL answered HTTP {status} without a Location")
            url = urljoin(url, location)
            try:
                self._split(url)
            except ImageFetchRefused as e:
                raise ImageFetchRefused(
                    f"the image URL redirects to {_shown(url)}, which is refused: {e}"
                ) from None
        raise ImageFetchRefused(f"the image URL redirects more than {self.config.max_redirects} times")

    # ---- internals -------------------------------------------------------------------------------
    def _split(self, url: str):
        if not isinstance(url, str):
            raise ImageFetchRefused("the image URL is not a string")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ImageFetchRefused(f"the image URL is malformed ({e})") from None
        if parts.scheme not in ("http", "https"):
            raise ImageFetchRefused(f"the image URL's scheme {parts.scheme!r} is not http or https")
        host = (parts.hostname or "").lower()
        if not host:
            raise ImageFetchRefused("the image URL has no host")
        if parts.username is not None or parts.password is not None:
            raise ImageFetchRefused("the image URL carries credentials; this server does not send them")
        allowed = host in self._hosts or (port is not None and f"{host}:{port}" in self._hosts)
        if not allowed:
            raise ImageFetchRefused(
                f"host {host!r} is not in this server's allow-list for image URLs "
                f"({', '.join(sorted(self._hosts))})"
            )
        return parts, host, port

    def _get(self, url: str, deadline: float) -> tuple[int, str | None, bytes]:
        parts, host, port = self._split(url)
        left = _time_left(deadline)
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=left, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=left)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query

        def cut_off() -> None:
            # A socket timeout bounds each read, not the exchange: a server that sends a header line
            # every half second would hold the fetch without end. At the deadline the socket is shut.
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(left, cut_off)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "ced-jax"})
            # The connection drops its socket reference once a response will close it; the response
            # still reads from that socket, so keep it to set each read's timeout.
            sock = conn.sock
            sock.settimeout(_time_left(deadline))
            resp = conn.getresponse()
            if resp.status in _REDIRECTS or resp.status != 200:
                return resp.status, resp.getheader("Location"), b""
            length = resp.getheader("Content-Length")
            limit = self.config.max_bytes
            if length is not None and length.isdigit() and int(length) > limit:
                raise ImageFetchRefused(
                    f"the image at the URL is {int(length)} bytes; this server fetches at most {limit}"
                )
            chunks, got = [], 0
            while True:
                sock.settimeout(_time_left(deadline))
                chunk = resp.read1(_READ_CHUNK)
                if not chunk:
                    break
                got += len(chunk)
                if got > limit:
                    raise ImageFetchRefused(
                        f"the image at the URL is over {limit} bytes, this server's limit"
                    )
                chunks.append(chunk)
                _time_left(deadline)
            return 200, None, b"".join(chunks)
        except (TimeoutError, ImageFetchRefused):
            raise
        except (OSError, http.client.HTTPException) as e:
            _time_left(deadline)  # cut off by the watchdog: a timeout, not the server's failure
            raise ImageFetchRefused(f"fetching the image URL failed ({type(e).__name__}: {e})") from None
        finally:
            watchdog.cancel()
            conn.close()


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _shown(url: str) -> str:
    """The URL without its query (which may carry tokens) for an error message."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc}{p.path}"
