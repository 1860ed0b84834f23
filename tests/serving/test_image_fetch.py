"""Image URL fetching (serving/image_fetch.py) against a real HTTP server on 127.0.0.1.

The server (threaded `http.server`) serves the golden PNG, a large body, a slow body, and redirects; the
allow-list names `127.0.0.1`, so the same server reached as `localhost` is a host that is not allowed.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serving.image_fetch import ImageFetchConfig, ImageFetcher, ImageFetchRefused

PNG = (Path(__file__).resolve().parents[1] / "golden" / "tiny-v" / "image1.png").read_bytes()
BIG = 200_000  # over the default test limit (BIG // 2), which the 58 kB PNG is under


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes, length: bool = True, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's naming
        port = self.server.server_address[1]
        if self.path == "/image.png":
            self._send(200, PNG)
        elif self.path == "/big-declared.png":
            self._send(200, bytes(BIG))
        elif self.path == "/big-undeclared.png":
            self.close_connection = True
            self._send(200, bytes(BIG), length=False)
        elif self.path == "/slow.png":
            self.close_connection = True
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # a byte every 50 ms: each read is quick, the whole is not
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        elif self.path == "/slow-headers.png":  # issue 33.4: a header line every 0.25 s, for 10 s
            self.close_connection = True
            self.send_response(200)
            for i in range(40):
                self.send_header(f"X-Slow-{i}", "x")
                self.flush_headers()
                time.sleep(0.25)
            self.end_headers()
        elif self.path == "/stall.png":
            time.sleep(1.5)
            self._send(200, PNG)
        elif self.path == "/redirect-ok":
            self._send(302, b"", headers={"Location": "/image.png"})
        elif self.path == "/redirect-away":
            self._send(302, b"", headers={"Location": f"http://localhost:{port}/image.png"})
        elif self.path == "/redirect-loop":
            self._send(302, b"", headers={"Location": "/redirect-loop"})
        else:
            self._send(404, b"")


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def _fetcher(**kw) -> ImageFetcher:
    cfg = dict(allow_image_urls=True, allowed_hosts=("127.0.0.1",), max_bytes=BIG // 2, timeout_s=0.8)
    cfg.update(kw)
    return ImageFetcher(ImageFetchConfig(**cfg))


def test_off_by_default_says_how_to_send_images_instead(server):
    with pytest.raises(ImageFetchRefused, match="disabled.*base64.*file id"):
        ImageFetcher().fetch(f"http://127.0.0.1:{server}/image.png")


def test_allowed_host_gets_the_bytes(server):
    assert _fetcher().fetch(f"http://127.0.0.1:{server}/image.png") == PNG


def test_host_not_in_the_allow_list_is_refused_before_connecting(server):
    with pytest.raises(ImageFetchRefused, match="'localhost' is not in this server's allow-list"):
        _fetcher().fetch(f"http://localhost:{server}/image.png")


def test_host_and_port_entry_pins_the_port(server):
    f = _fetcher(allowed_hosts=(f"127.0.0.1:{server}",))
    assert f.fetch(f"http://127.0.0.1:{server}/image.png") == PNG
    with pytest.raises(ImageFetchRefused, match="allow-list"):
        f.fetch(f"http://127.0.0.1:{server + 1 if server < 65535 else server - 1}/image.png")


@pytest.mark.parametrize("path", ["/big-declared.png", "/big-undeclared.png"])
def test_too_big_is_refused(server, path):
    with pytest.raises(ImageFetchRefused, match=f"{BIG // 2}"):
        _fetcher().fetch(f"http://127.0.0.1:{server}{path}")
    assert len(_fetcher(max_bytes=BIG).fetch(f"http://127.0.0.1:{server}{path}")) == BIG


@pytest.mark.parametrize("path", ["/slow.png", "/stall.png", "/slow-headers.png"])
def test_slow_is_refused_at_the_time_limit(server, path):
    t0 = time.monotonic()
    with pytest.raises(ImageFetchRefused, match="took over 0.8 s"):
        _fetcher().fetch(f"http://127.0.0.1:{server}{path}")
    assert time.monotonic() - t0 < 1.4  # stopped at the limit, not at the end of the body


def test_redirects_only_to_allowed_hosts(server):
    assert _fetcher().fetch(f"http://127.0.0.1:{server}/redirect-ok") == PNG
    with pytest.raises(ImageFetchRefused, match="redirects to http://localhost.*allow-list"):
        _fetcher().fetch(f"http://127.0.0.1:{server}/redirect-away")
    with pytest.raises(ImageFetchRefused, match="redirects more than 3 times"):
        _fetcher().fetch(f"http://127.0.0.1:{server}/redirect-loop")
    with pytest.raises(ImageFetchRefused, match="redirect"):
        _fetcher(max_redirects=0).fetch(f"http://127.0.0.1:{server}/redirect-ok")


def test_other_refusals_say_why(server):
    f = _fetcher()
    with pytest.raises(ImageFetchRefused, match="HTTP 404"):
        f.fetch(f"http://127.0.0.1:{server}/missing.png")
    with pytest.raises(ImageFetchRefused, match="scheme 'ftp'"):
        f.fetch("ftp://127.0.0.1/image.png")
    with pytest.raises(ImageFetchRefused, match="credentials"):
        f.fetch(f"http://user:pw@127.0.0.1:{server}/image.png")


def test_config_is_validated():
    with pytest.raises(ValueError, match="no host is allowed"):
        ImageFetchConfig(allow_image_urls=True)
    with pytest.raises(ValueError, match="max_bytes"):
        ImageFetchConfig(max_bytes=0)
    with pytest.raises(ValueError, match="allowed_hosts"):
        ImageFetchConfig(allowed_hosts=("http://x.org",))
