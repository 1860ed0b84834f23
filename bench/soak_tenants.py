"""The tenant phase of bench/soak.py: one tenant attacks, another measures its own latency.

Run by `bench/soak.py ... --http HOST:PORT --api-key A --victim-key B` against a server with two API
keys (two tenants). For `--tenant-s` seconds tenant A runs the adversarial classes below, each
`--attackers` calls at a time, while tenant B sends one small request every 0.25 s, in turn a gRPC
Generate (one token), an HTTP chat completion (one token) and a gRPC Tokenize. B's latencies, idle
before the attack and under it, are the per-tenant figure; any B request slower than
`--victim-limit-s` (default 1 s) is a failure, as is an answer a class does not allow.

| class | what tenant A sends | acceptable answers |
|---|---|---|
| big_body | HTTP chat of `--big-bytes` of text (default: under 1 MiB, max_prompt_bytes) | 200, 400, 429 |
| huge_body | headers announcing a 1 GiB body, none of it sent: the 413 must come first | 413, 429 |
| unknown_keys | an HTTP body with 6,000 unknown keys and one value of a wrong type | 400, 429 |
| slow_image | HTTP chat, image URL on `--slow-image-port` (a header line per 0.5 s) | 400, 429 |
| files_quota | 1 MiB uploads until 413, then deletes them all | 200, 413, 429 |
| tokenize_big | gRPC Tokenize of big-bytes of text | OK, RESOURCE_EXHAUSTED |

After the attack B uploads a file and must get 200 (A's full quota is A's). slow_image needs a
server started with `--allow-image-urls 127.0.0.1:PORT` for the same port and a model that takes
images; without `--slow-image-port` the class is not run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import http.client
import io
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import grpc.aio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the victim process

from serving.proto import ced_pb2, ced_pb2_grpc  # noqa: E402

ACCEPT = {
    "big_body": {"200", "400", "429"},
    "huge_body": {"413", "429"},
    "unknown_keys": {"400", "429"},
    "slow_image": {"400", "429"},
    "files_quota": {"200", "413", "429"},
    "tokenize_big": {"OK", "RESOURCE_EXHAUSTED"},
}
VICTIM_PERIOD_S = 0.25
FILE_BYTES = 1 << 20
HUGE_BYTES = 1 << 30  # past any body limit a server is likely to have (default: 4 x max_prompt_bytes + 1 MiB)


class _Trickle(BaseHTTPRequestHandler):
    """An image host that never finishes its headers: one header line every 0.5 s."""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200)
        try:
            for i in range(600):
                self.send_header(f"x-slow-{i}", "1")
                self.flush_headers()
                time.sleep(0.5)
        except OSError:
            pass

    def log_message(self, *args):
        pass


class TenantPhase:
    def __init__(self, args, grpc_addr: str, http_base: str):
        self.args = args
        self.grpc_addr = grpc_addr
        self.http = http_base.rstrip("/")
        self.answers: dict[str, collections.Counter] = {c: collections.Counter() for c in ACCEPT}
        self.problems: list[str] = []
        self.victim: dict[str, dict[str, list[float]]] = {"idle": {}, "attack": {}}
        self._attack_pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="attack")
        self._png = _noise_png(FILE_BYTES)

    # ---- HTTP, blocking (on the pools above) ----
    def _post(self, key: str, path: str, body: bytes, content_type: str = "application/json") -> str:
        req = urllib.request.Request(
            self.http + path,
            data=body,
            headers={"content-type": content_type, "authorization": f"Bearer {key}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.args.request_timeout) as r:
                r.read()
                return str(r.status)
        except urllib.error.HTTPError as e:
            return str(e.code)
        except (urllib.error.URLError, OSError) as e:
            return f"connection error: {e}"

    def _announce_huge_body(self, key: str, length: int) -> str:
        """Headers announcing `length` bytes, then the answer, the body never sent: the refusal must
        come before any of it is read (a client sending it all would meet a closed connection)."""
        host, port = self.http.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=self.args.request_timeout)
        try:
            conn.putrequest("POST", "/v1/chat/completions")
            for name, value in (("content-type", "application/json"), ("content-length", str(length)),
                                ("authorization", f"Bearer {key}")):  # fmt: skip
                conn.putheader(name, value)
            conn.endheaders()
            return str(conn.getresponse().status)
        except OSError as e:
            return f"connection error: {e}"
        finally:
            conn.close()

    def _delete(self, key: str, path: str) -> str:
        req = urllib.request.Request(
            self.http + path, method="DELETE", headers={"authorization": f"Bearer {key}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return str(r.status)
        except urllib.error.HTTPError as e:
            return str(e.code)

    def _upload(self, key: str, data: bytes) -> tuple[str, str | None]:
        boundary = uuid.uuid4().hex
        body = (
            (
                f'--{boundary}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nvision\r\n'
                f'--{boundary}\r\ncontent-disposition: form-data; name="file"; filename="x.png"\r\n'
                "content-type: image/png\r\n\r\n"
            ).encode()
            + data
            + f"\r\n--{boundary}--\r\n".encode()
        )
        req = urllib.request.Request(
            self.http + "/v1/files",
            data=body,
            headers={
                "content-type": f"multipart/form-data; boundary={boundary}",
                "authorization": f"Bearer {key}",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return str(r.status), json.loads(r.read())["id"]
        except urllib.error.HTTPError as e:
            return str(e.code), None

    @staticmethod
    def _chat(content, max_tokens: int = 1, **extra) -> bytes:
        body = {
            "model": "deepseek-flash",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "thinking": {"type": "disabled"},
            **extra,
        }
        return json.dumps(body).encode()

    # ---- the attack ----
    def _attack_once(self, cls: str, i: int, end: float) -> list[str]:
        key, big = self.args.api_key, self.args.big_bytes
        if cls == "big_body":
            return [self._post(key, "/v1/chat/completions", self._chat("a " * (big // 2 - 64)))]
        if cls == "huge_body":
            return [self._announce_huge_body(key, HUGE_BYTES)]
        if cls == "unknown_keys":
            body = {f"unknown_{k}": k for k in range(6000)}
            body.update(json.loads(self._chat("hi")), temperature="hot")
            return [self._post(key, "/v1/chat/completions", json.dumps(body).encode())]
        if cls == "slow_image":
            url = f"http://127.0.0.1:{self.args.slow_image_port}/slow-{i}.png"
            parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]
            return [self._post(key, "/v1/chat/completions", self._chat(parts))]
        if cls == "files_quota":
            answers, ids = [], []
            while time.monotonic() < end:
                status, file_id = self._upload(key, self._png)
                answers.append(status)
                if file_id is None:
                    break
                ids.append(file_id)
            for file_id in ids:
                self._delete(key, f"/v1/files/{file_id}")
            return answers
        raise AssertionError(cls)

    async def _grpc_tokenize_big(self, stub) -> str:
        metadata = (("authorization", f"Bearer {self.args.api_key}"),)
        text = "a " * (self.args.big_bytes // 2 - 64)
        try:
            await stub.Tokenize(ced_pb2.TokenizeRequest(text=text), timeout=120, metadata=metadata)
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def _attacker(self, cls: str, worker: int, end: float, stub) -> None:
        loop = asyncio.get_running_loop()
        i = worker
        while time.monotonic() < end:
            if cls == "tokenize_big":
                answers = [await self._grpc_tokenize_big(stub)]
            else:
                answers = await loop.run_in_executor(self._attack_pool, self._attack_once, cls, i, end)
            for a in answers:
                self.answers[cls][a] += 1
                if a not in ACCEPT[cls]:
                    self.problems.append(f"{cls}: answer {a}")
            i += self.args.attackers

    async def run(self) -> dict:
        args = self.args
        trickle = None
        if args.slow_image_port:
            trickle = ThreadingHTTPServer(("127.0.0.1", args.slow_image_port), _Trickle)
            trickle.daemon_threads = True
            threading.Thread(target=trickle.serve_forever, daemon=True).start()
        chosen = args.tenant_classes.split(",") if args.tenant_classes else list(ACCEPT)
        classes = [c for c in chosen if c != "slow_image" or args.slow_image_port]
        loop = asyncio.get_running_loop()
        # The victim is another process: in this one the attack's client work (building and sending
        # megabyte bodies) would hold the GIL and the victim would measure its own client.
        plan = (self.grpc_addr, self.http, args.victim_key)
        self.victim["idle"] = await _victim_process(*plan, 3.0)
        async with grpc.aio.insecure_channel(self.grpc_addr) as channel:
            stub = ced_pb2_grpc.InferenceServiceStub(channel)
            end = time.monotonic() + args.tenant_s
            attackers = [
                asyncio.ensure_future(self._attacker(c, w, end, stub))
                for c in classes
                for w in range(args.attackers)
            ]
            await asyncio.sleep(1.0)  # the attack under way before the victim measures
            self.victim["attack"] = await _victim_process(*plan, end - time.monotonic())
            await asyncio.gather(*attackers)
        # A's quota was A's: B can still upload.
        status, file_id = await loop.run_in_executor(
            self._attack_pool, self._upload, args.victim_key, _noise_png(4096)
        )
        if status != "200":
            self.problems.append(f"victim upload after the attack: {status}")
        elif file_id is not None:
            await loop.run_in_executor(
                self._attack_pool, self._delete, args.victim_key, f"/v1/files/{file_id}"
            )
        for phase in self.victim.values():
            for kind, answers in phase.pop("answers", {}).items():
                self.problems += [f"victim {kind}: answer {a}" for a in answers if a not in ("OK", "200")]
        if trickle is not None:
            trickle.shutdown()
        self._attack_pool.shutdown(wait=False, cancel_futures=True)
        return self.result(classes)

    def result(self, classes: list[str]) -> dict:
        def stats(values: list[float]) -> dict:
            if not values:
                return {"n": 0}
            v = np.asarray(values) * 1e3
            return {"n": len(v), "p50_ms": float(np.median(v)), "p90_ms": float(np.percentile(v, 90)),
                    "max_ms": float(v.max())}  # fmt: skip

        victim = {phase: {k: stats(v) for k, v in kinds.items()} for phase, kinds in self.victim.items()}
        slowest = max((max(v) for v in self.victim["attack"].values() if v), default=None)
        failures = []
        if slowest is None:
            failures.append("the victim sent nothing during the attack")
        elif slowest > self.args.victim_limit_s:
            failures.append(
                f"a victim request took {slowest:.2f} s under the attack (limit {self.args.victim_limit_s} s)"
            )
        if self.problems:
            failures.append(f"{len(self.problems)} unacceptable answers")
        return {
            "classes": {c: dict(self.answers[c]) for c in classes},
            "victim": victim,
            "victim_slowest_s": slowest,
            "problems": self.problems[:50],
            "failures": failures,
        }


def _noise_png(size: int) -> bytes:
    """A PNG of about `size` bytes (noise does not compress): the Files API takes images only."""
    from PIL import Image

    side = max(8, int((size / 3) ** 0.5))
    pixels = np.random.default_rng(size).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _victim_requests(grpc_addr: str, http_base: str, key: str, seconds: float) -> dict:
    """One small request every VICTIM_PERIOD_S for `seconds`, in turn a gRPC Generate (one token), an
    HTTP chat completion (one token) and a gRPC Tokenize: {kind: [seconds]} plus their answers."""
    metadata = (("authorization", f"Bearer {key}"),)
    times: dict[str, list[float]] = {}
    answers: dict[str, list[str]] = {}
    end = time.monotonic() + seconds
    with grpc.insecure_channel(grpc_addr) as channel:
        stub = ced_pb2_grpc.InferenceServiceStub(channel)
        stub.GetModelInfo(ced_pb2.GetModelInfoRequest(), timeout=60, metadata=metadata)  # connected first
        n = 0
        while time.monotonic() < end:
            start = time.monotonic()
            kind = ("grpc_generate", "http_chat", "grpc_tokenize")[n % 3]
            t0 = time.perf_counter()
            try:
                if kind == "http_chat":
                    body = TenantPhase._chat(f"hello {n}")
                    req = urllib.request.Request(
                        http_base + "/v1/chat/completions", data=body,
                        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
                    )  # fmt: skip
                    with urllib.request.urlopen(req, timeout=60) as r:
                        r.read()
                        answer = str(r.status)
                elif kind == "grpc_tokenize":
                    stub.Tokenize(ced_pb2.TokenizeRequest(text=f"hello {n}"), timeout=60, metadata=metadata)
                    answer = "OK"
                else:
                    req = ced_pb2.GenerateRequest(request_id=f"victim-{n}", prompt=f"hello {n}", max_tokens=1)
                    for _ in stub.Generate(req, timeout=60, metadata=metadata):
                        pass
                    answer = "OK"
            except grpc.RpcError as e:
                answer = e.code().name
            except urllib.error.HTTPError as e:
                answer = str(e.code)
            except OSError as e:
                answer = f"connection error: {e}"
            times.setdefault(kind, []).append(time.perf_counter() - t0)
            answers.setdefault(kind, []).append(answer)
            n += 1
            time.sleep(max(0.0, VICTIM_PERIOD_S - (time.monotonic() - start)))
    return {**times, "answers": answers}


async def _victim_process(grpc_addr: str, http_base: str, key: str, seconds: float) -> dict:
    """`_victim_requests` in a process of its own (this file run as a script)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), grpc_addr, http_base, key, str(max(0.1, seconds)),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the victim process failed (exit {proc.returncode})")
    return json.loads(out)


def add_arguments(p) -> None:
    g = p.add_argument_group("tenant phase (needs --http, --api-key and --victim-key)")
    g.add_argument("--http", help="HOST:PORT of the server's HTTP API (loopback only)")
    g.add_argument("--victim-key", help="the API key of the tenant that measures its latency")
    g.add_argument("--tenant-s", type=float, default=30.0, help="seconds of attack")
    g.add_argument("--attackers", type=int, default=6, help="calls at a time per adversarial class")
    g.add_argument("--big-bytes", type=int, default=(1 << 20) - 4096, help="text bytes of the big classes")
    g.add_argument("--slow-image-port", type=int, default=0, help="serve the trickling image host here")
    g.add_argument("--victim-limit-s", type=float, default=1.0, help="slowest victim request allowed, s")
    g.add_argument("--tenant-classes", help=f"comma-separated subset of {','.join(ACCEPT)} (default: all)")


def print_report(result: dict, w) -> None:
    w("tenant phase: answers of the attacking tenant by class")
    for cls, answers in result["classes"].items():
        w(f"  {cls}: {answers}")
    w("| victim request | idle p50 ms | under attack p50 / p90 / max ms | n |")
    w("|---|---|---|---|")
    for kind, s in result["victim"]["attack"].items():
        idle = result["victim"]["idle"].get(kind, {})
        idle_p50 = f"{idle['p50_ms']:.0f}" if idle.get("n") else "-"
        w(f"| {kind} | {idle_p50} | {s['p50_ms']:.0f} / {s['p90_ms']:.0f} / {s['max_ms']:.0f} | {s['n']} |")
    for p in result["problems"][:20]:
        w(f"tenant phase problem: {p}")


if __name__ == "__main__":
    grpc_addr, http_base, key, seconds = sys.argv[1:]
    print(json.dumps(_victim_requests(grpc_addr, http_base, key, float(seconds))))
