"""Soak test: a bounded storm of mixed, hostile requests against a running ced-jax server on this host.

    python bench/soak.py 127.0.0.1:50051 --metrics 127.0.0.1:9464 --pid PID \\
        --requests 400 --concurrency 48 --duration 600 [--json soak.json]

Requests are drawn (seeded) from these classes and sent over gRPC with at most `--concurrency`
streams open at once; each class has the answers it may get, anything else is a problem:

| class | what it does | acceptable answers |
|---|---|---|
| normal | text or id prompt (some share a prefix), greedy or seeded sampling | OK (stop/length) |
| stop_string | one to three short stop strings; the text must not contain them | OK |
| logprobs | 1..max_logprobs alternatives: one entry per token, `top` as long as asked | OK |
| cancel | the client cancels after a few messages | CANCELLED, OK |
| client_kill | the client closes its own channel abruptly after the first message | CANCELLED, OK |
| abort_rpc | a long stream, then `Abort(request_id)`; found => the stream ends ABORT | OK |
| duplicate_id | a second request with the id of a live one | ALREADY_EXISTS |
| malformed | one bad field per request, each kind in turn (`_malformed_cases`) | INVALID_ARGUMENT + field |
| deadline | gRPC deadlines from 1 ms to 1 s | DEADLINE_EXCEEDED, OK |
| tokenize_big | Tokenize of 16 KiB .. 6 MiB of text | OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED |
| determinism | one fixed seeded request, repeated under load: all completions equal | OK |
| overload | bursts of max_running + max_queued + 8 long streams on top of the mix, | RESOURCE_EXHAUSTED, |
|          | held `--burst-hold` s, then cancelled | CANCELLED, OK |

Every streaming class may also get RESOURCE_EXHAUSTED (the bursts fill the queue). If the server's
GenerateRequest has a `user` field (read from the server's own descriptor over gRPC reflection),
every request carries one of three user names, and tenant checks run at the end: a prompt cached
by one user gives another user no prefix-cache hit; two users may have the same request id in
flight; and (if AbortRequest has `user` too) one user cannot abort another's request. With
`--api-key` (a server with API keys: the key, not `user`, is the identity) the tenant checks are
skipped.

Tenant phase (`--http HOST:PORT --api-key A --victim-key B`, a server with both keys): after the mix,
tenant A attacks (big bodies, over-limit bodies, 6,000 unknown keys, slow image URLs, the Files quota,
big Tokenize calls) while tenant B measures its own small requests; see bench/soak_tenants.py.

Reported: requests by class and answer (gRPC status; OK answers with their finish reason), TTFT
(request sent -> first message) and total latency (sent -> last message or error; RESOURCE_EXHAUSTED
refusals left out) per class, the server's KV pages / slots / queue after the soak (from
`--metrics`, the gauges of `serving/metrics.py`), its RSS before and after
(`--pid`: /proc/PID/status VmRSS; otherwise the `process_resident_memory_bytes` metric when the
server exports it), and the determinism check. Exit status 1 if any answer was UNKNOWN or INTERNAL
or otherwise unacceptable, pages or slots leaked, determinism failed, or the server stopped
answering; 2 for bad arguments (the address must be a loopback address: this tool attacks the
server it talks to).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import dataclasses
import ipaddress
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import soak_tenants  # noqa: E402
from serving.proto import ced_pb2, ced_pb2_grpc  # noqa: E402

SERVICE = ced_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
FINISH = {
    ced_pb2.FINISH_REASON_STOP: "stop",
    ced_pb2.FINISH_REASON_LENGTH: "length",
    ced_pb2.FINISH_REASON_ABORT: "abort",
}
# Relative frequencies of the classes in the mix (overload bursts come on top).
MIX = {
    "normal": 20,
    "stop_string": 8,
    "logprobs": 8,
    "cancel": 8,
    "client_kill": 6,
    "abort_rpc": 6,
    "duplicate_id": 5,
    "malformed": 14,
    "deadline": 8,
    "tokenize_big": 3,
    "determinism": 4,
}
CLASSES = (*MIX, "overload")
FATAL_STATUSES = ("UNKNOWN", "INTERNAL")
USERS = ("soak-alice", "soak-bob", "soak-carol")
# The answers recorded by the current mix task (a task-local list; None outside the mix).
_TASK_ANSWERS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("answers", default=None)
LEAK_GAUGES = ("ced_kv_pages_used", "ced_active_slots", "ced_queue_depth")


class UsageError(ValueError):
    """Bad command-line input (exit 2)."""


def loopback_address(addr: str, what: str) -> tuple[str, int]:
    """(host, port) of a `host:port` (or `http://host:port/...`) address on this machine, else UsageError."""
    rest = addr.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"{what}: expected HOST:PORT, got {addr!r}")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False  # a host name other than localhost: never resolved, never attacked
        if not loopback:
            raise UsageError(
                f"{what}: {host} is not a loopback address; the soak only runs against this host"
            )
    return host, int(port)


# ------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class Record:
    cls: str
    answer: str  # gRPC status name; "OK/<finish reason>" for a completed stream
    ttft_s: float | None
    total_s: float
    problem: str | None = None  # why this answer is not acceptable


@dataclasses.dataclass
class StreamResult:
    status: str
    details: str = ""
    finish: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    messages: list = dataclasses.field(default_factory=list)
    ttft_s: float | None = None
    total_s: float = 0.0

    @property
    def answer(self) -> str:
        if self.status != "OK" or not self.messages:
            return self.status  # a unary call's OK has no finish reason
        return f"OK/{self.finish}"


def _check_stream(res: StreamResult, req: ced_pb2.GenerateRequest, vocab: int) -> str | None:
    """What is wrong with a completed (OK) stream, or None."""
    if res.status != "OK":
        return None
    msgs = res.messages
    if not msgs or msgs[-1].finish_reason == ced_pb2.FINISH_REASON_UNSPECIFIED:
        return "stream ended OK without a finish_reason"
    if any(m.finish_reason != ced_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1]):
        return "finish_reason before the last message"
    if any(not 0 <= t < vocab for t in res.token_ids):
        return "token id outside the vocabulary"
    if req.max_tokens and len(res.token_ids) > req.max_tokens:
        return f"{len(res.token_ids)} tokens for max_tokens {req.max_tokens}"
    if msgs[-1].usage.completion_tokens < len(res.token_ids):
        return "usage.completion_tokens below the tokens sent"
    for m in msgs:
        if req.logprobs and (
            len(m.logprobs) != len(m.token_ids) or any(len(e.top) != req.logprobs for e in m.logprobs)
        ):
            return f"logprobs: {len(m.logprobs)} entries for {len(m.token_ids)} tokens, asked {req.logprobs}"
        if not req.logprobs and m.logprobs:
            return "logprobs sent without being asked"
    for s in req.stop:
        if s in res.text:
            return f"stop string {s!r} in the returned text"
    return None


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    p = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return {"p50_ms": float(p[0]), "p90_ms": float(p[1]), "p99_ms": float(p[2])}


# ------------------------------------------------------------------------------------- metrics
def scrape(metrics_addr: str, timeout: float = 10.0) -> dict[str, float]:
    """Unlabelled samples of the server's /metrics (name -> value)."""
    host, port = loopback_address(metrics_addr, "--metrics")
    host = f"[{host}]" if ":" in host else host
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        body = r.read().decode()
    return {
        s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples if not s.labels
    }


def rss_bytes(pid: int | None, metrics: dict[str, float] | None) -> int | None:
    if pid is not None:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    if metrics and "process_resident_memory_bytes" in metrics:
        return int(metrics["process_resident_memory_bytes"])
    return None


# ------------------------------------------------------------------------------------- the soak
class Soak:
    def __init__(self, args, info: ced_pb2.ModelInfo, users: tuple[str, ...], abort_has_user: bool):
        self.args = args
        self.addr = args.addr
        self.info = info
        self.limits = info.limits
        self.vocab = info.vocab_size
        self.users = users
        self.abort_has_user = abort_has_user
        self.rng = random.Random(args.seed)
        self.records: list[Record] = []
        self.fixed_completions: list[tuple[str, list[int]]] = []  # (answer, tokens) of the fixed request
        self.counter = 0
        self._malformed_next = 0
        ctx = info.limits.max_context
        self.prompt_budget = ctx // 2
        self.max_tokens = max(1, min(args.max_tokens, self.limits.max_tokens, ctx // 4))
        self.page = max(1, info.page_size)
        fixed = random.Random(args.seed + 1)
        self.shared_prefix = [fixed.randrange(3, self.vocab) for _ in range(min(2 * self.page, ctx // 4))]
        self.fixed_prompt = [fixed.randrange(3, self.vocab) for _ in range(min(2 * self.page + 3, ctx // 4))]
        # With API keys the key is the identity and `user` is unused, so the tenant checks need keys.
        self.metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
        self.channel: grpc.aio.Channel | None = None
        self.stub: ced_pb2_grpc.InferenceServiceStub | None = None

    # ---- request building ----
    def _rid(self, cls: str) -> str:
        self.counter += 1
        return f"soak-{self.args.seed}-{self.counter}-{cls}"

    def _prompt(self, rng: random.Random, budget: int | None = None):
        budget = budget or self.prompt_budget
        kind = rng.random()
        if kind < 0.35:  # text; at most 3 tokens per character whatever the tokenizer (UTF-8 bytes)
            words = ["soak", "héllo", "world", "ünïcode", "tokens", "стоп", "page", "数据"]
            text = ""
            while len(text) * 3 + 12 < budget:
                text += rng.choice(words) + " "
                if rng.random() < 0.3:
                    break
            return text.strip() or "soak"
        n = rng.randint(1, max(1, budget))
        ids = [rng.randrange(3, self.vocab) for _ in range(n)]
        if kind < 0.6 and len(self.shared_prefix) < budget:  # share pages with other requests
            ids = (self.shared_prefix + ids)[:budget]
        return ids

    def _request(self, cls: str, prompt, **kw) -> ced_pb2.GenerateRequest:
        req = ced_pb2.GenerateRequest(request_id=self._rid(cls), **kw)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.ids.extend(prompt)
        if self.users:
            req.user = self.rng.choice(self.users)
        return req

    def _sampling(self, rng: random.Random) -> dict:
        if rng.random() < 0.4:
            return {"sampling": ced_pb2.SamplingParams(temperature=0.0)}
        return {
            "sampling": ced_pb2.SamplingParams(
                temperature=rng.choice([0.3, 0.8, 1.0, 1.5]),
                top_p=rng.choice([0.5, 0.9, 1.0]),
                top_k=rng.choice([0, 1, 5, 40]),
                seed=rng.randrange(2**32),
            )
        }

    def _long_request(self, cls: str) -> ced_pb2.GenerateRequest:
        """A stream that stays in flight for a while (short prompt, as many tokens as allowed)."""
        prompt = [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(1, self.page))]
        room = self.limits.max_context - len(prompt) - 1
        return self._request(
            cls, prompt, max_tokens=max(1, min(self.limits.max_tokens, room)), ignore_eos=True,
            sampling=ced_pb2.SamplingParams(temperature=0.0),
        )  # fmt: skip

    # ---- one streaming call ----
    async def _stream(
        self,
        req,
        *,
        timeout: float | None = None,
        stop_after: int | None = None,
        stub=None,
        on_first=None,
        raw: bytes | None = None,
    ) -> StreamResult:
        """Runs one Generate call. stop_after: cancel after that many messages; on_first: awaited
        after the first message (its return value is ignored); raw: send these bytes as the request."""
        timeout = self.args.request_timeout if timeout is None else timeout
        if raw is not None:
            method = self.channel.unary_stream(
                f"/{SERVICE}/Generate", response_deserializer=ced_pb2.GenerateResponse.FromString
            )
            call = method(raw, timeout=timeout, metadata=self.metadata)
        else:
            call = (stub or self.stub).Generate(req, timeout=timeout, metadata=self.metadata)
        res = StreamResult(status="OK")
        t0 = time.perf_counter()
        try:
            async for msg in call:
                if res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - t0
                res.messages.append(msg)
                res.token_ids.extend(msg.token_ids)
                res.text += msg.text
                if msg.finish_reason != ced_pb2.FINISH_REASON_UNSPECIFIED:
                    res.finish = FINISH.get(msg.finish_reason, str(msg.finish_reason))
                if len(res.messages) == 1 and on_first is not None:
                    if await on_first():
                        call.cancel()
                        res.status = "CANCELLED"
                        break
                if stop_after is not None and len(res.messages) >= stop_after and res.finish is None:
                    call.cancel()
                    res.status = "CANCELLED"
                    break
        except grpc.aio.AioRpcError as e:
            res.status, res.details = e.code().name, e.details() or ""
        except asyncio.CancelledError:
            res.status = "CANCELLED"
        res.total_s = time.perf_counter() - t0
        return res

    def _record(self, cls: str, res: StreamResult, allowed: set[str], problem: str | None = None) -> None:
        if problem is None and res.status in FATAL_STATUSES:
            problem = f"{res.status}: {res.details}"
        if problem is None and res.answer not in allowed and res.status not in allowed:
            problem = f"unexpected {res.answer}: {res.details}"
        self.records.append(Record(cls, res.answer, res.ttft_s, res.total_s, problem))
        answers = _TASK_ANSWERS.get()
        if answers is not None:
            answers.append(res.answer)

    async def _mix_one(self, cls: str, rng: random.Random) -> None:
        """One request of the mix. A refused one (RESOURCE_EXHAUSTED) keeps its concurrency place for
        --burst-hold s, as a client backing off would; otherwise an overload burst would make the mix
        spin through its whole request budget in refusals."""
        answers: list[str] = []
        _TASK_ANSWERS.set(answers)  # this task's own context (asyncio copies it per task)
        await getattr(self, cls)(rng)
        if "RESOURCE_EXHAUSTED" in answers:
            await asyncio.sleep(self.args.burst_hold)

    # ---- the classes ----
    async def normal(self, rng: random.Random, cls: str = "normal", **extra) -> StreamResult:
        budget = self.prompt_budget
        req = self._request(
            cls, self._prompt(rng, budget), max_tokens=rng.randint(1, self.max_tokens), **self._sampling(rng),
            **extra,
        )  # fmt: skip
        res = await self._stream(req)
        self._record(
            cls, res, {"OK/stop", "OK/length", "RESOURCE_EXHAUSTED"}, _check_stream(res, req, self.vocab)
        )
        return res

    async def stop_string(self, rng):
        letters = "abcdefghijklmnopqrstuvwxyz eé"
        stops = [
            "".join(rng.choice(letters) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))
        ]
        await self.normal(rng, "stop_string", stop=stops)

    async def logprobs(self, rng):
        await self.normal(rng, "logprobs", logprobs=rng.randint(1, max(1, self.limits.max_logprobs)))

    async def cancel(self, rng):
        req = self._long_request("cancel")
        res = await self._stream(req, stop_after=rng.randint(1, 4))
        self._record(
            "cancel",
            res,
            {"CANCELLED", "OK/length", "RESOURCE_EXHAUSTED"},
            _check_stream(res, req, self.vocab),
        )

    async def client_kill(self, rng):
        channel = grpc.aio.insecure_channel(self.addr)
        stub = ced_pb2_grpc.InferenceServiceStub(channel)
        req = self._long_request("client_kill")

        async def kill():
            await channel.close(grace=None)  # no goodbye: every call on the channel dies at once
            return True

        try:
            res = await self._stream(req, stub=stub, on_first=kill)
        finally:
            await channel.close(grace=None)
        self._record(
            "client_kill",
            res,
            {"CANCELLED", "OK/length", "RESOURCE_EXHAUSTED"},
            _check_stream(res, req, self.vocab),
        )

    async def abort_rpc(self, rng):
        req = self._long_request("abort_rpc")
        found = []

        async def abort():
            found.append(await self._abort(req.request_id, req.user if self.users else None))
            return False

        res = await self._stream(req, on_first=abort)
        problem = _check_stream(res, req, self.vocab)
        if problem is None and found == [True] and res.answer != "OK/abort":
            problem = f"Abort found the request but the stream ended {res.answer}"
        if problem is None and found == [False] and res.finish is None:
            problem = "Abort did not find a request that was still streaming"
        self._record("abort_rpc", res, {"OK/abort", "OK/length", "RESOURCE_EXHAUSTED"}, problem)

    async def _abort(self, request_id: str, user: str | None) -> bool | str:
        req = ced_pb2.AbortRequest(request_id=request_id)
        if user is not None and self.abort_has_user:
            req.user = user
        try:
            return (await self.stub.Abort(req, timeout=30, metadata=self.metadata)).found
        except grpc.aio.AioRpcError as e:
            return f"Abort RPC failed: {e.code().name}: {e.details()}"

    async def duplicate_id(self, rng):
        orig = self._long_request("duplicate_id")
        dup_result: list[StreamResult] = []

        async def send_duplicate():
            dup = ced_pb2.GenerateRequest()
            dup.CopyFrom(orig)
            dup.max_tokens = 1
            dup_result.append(await self._stream(dup))
            return True  # then cancel the original

        res = await self._stream(orig, on_first=send_duplicate)
        self._record("duplicate_id (original)", res, {"CANCELLED", "OK/length", "RESOURCE_EXHAUSTED"})
        if dup_result:
            dup = dup_result[0]
            # The original was cancelled after the duplicate was answered, so it was in flight all along.
            live = res.status == "CANCELLED"
            # (RESOURCE_EXHAUSTED too: a full server may refuse before it looks at the id.)
            allowed = {"ALREADY_EXISTS", "RESOURCE_EXHAUSTED"}
            if not live:
                allowed |= {"OK/length", "OK/stop"}
            self._record("duplicate_id", dup, allowed)

    def _malformed_cases(self) -> list[tuple[str, str, object]]:
        """(name, field the error must name, GenerateRequest or raw bytes) for every kind of bad field."""
        L, V, ctx = self.limits, self.vocab, self.limits.max_context
        ok = {"prompt": "soak", "max_tokens": 2}

        def g(**kw):
            kw = {"request_id": self._rid("malformed"), **ok, **kw}
            prompt = kw.pop("prompt")
            req = ced_pb2.GenerateRequest(**kw)
            if isinstance(prompt, str):
                req.prompt = prompt
            elif prompt is not None:
                req.prompt_token_ids.SetInParent()
                req.prompt_token_ids.ids.extend(prompt)
            return req

        def sp(**kw):
            return ced_pb2.SamplingParams(**kw)

        def raw(field_tag: int, data: bytes, **kw) -> bytes:
            # A string field with bytes that are not UTF-8 (a Python client cannot build this message).
            return g(**kw).SerializeToString() + bytes([field_tag, len(data)]) + data

        bad_utf8 = b"so\xffak\xc3"
        extra = []
        max_user = getattr(L, "max_user_length", 0) if "max_user_length" in L.DESCRIPTOR.fields_by_name else 0
        if self.users and max_user:
            extra.append(("user_too_long", "user", g(user="u" * (max_user + 1))))
        return extra + [
            ("no_input", "prompt", g(prompt=None)),
            ("empty_text", "prompt", g(prompt="")),
            ("empty_ids", "prompt_token_ids", g(prompt=[])),
            ("id_vocab", "prompt_token_ids", g(prompt=[5, V])),
            ("id_negative", "prompt_token_ids", g(prompt=[5, -1])),
            ("id_huge", "prompt_token_ids", g(prompt=[2**31 - 1])),
            ("prompt_too_long", "prompt", g(prompt=[5] * ctx)),
            ("max_tokens_negative", "max_tokens", g(max_tokens=-1)),
            ("max_tokens_over", "max_tokens", g(max_tokens=L.max_tokens + 1)),
            ("temperature_nan", "sampling.temperature", g(sampling=sp(temperature=float("nan")))),
            ("temperature_inf", "sampling.temperature", g(sampling=sp(temperature=float("inf")))),
            ("temperature_negative", "sampling.temperature", g(sampling=sp(temperature=-0.5))),
            ("temperature_huge", "sampling.temperature", g(sampling=sp(temperature=1e30))),
            ("top_p_zero", "sampling.top_p", g(sampling=sp(top_p=0.0))),
            ("top_p_over", "sampling.top_p", g(sampling=sp(top_p=1.5))),
            ("top_p_nan", "sampling.top_p", g(sampling=sp(top_p=float("nan")))),
            ("top_k_negative", "sampling.top_k", g(sampling=sp(top_k=-3))),
            ("logprobs_negative", "logprobs", g(logprobs=-1)),
            ("logprobs_over", "logprobs", g(logprobs=L.max_logprobs + 1)),
            ("stop_too_many", "stop", g(stop=["x"] * (L.max_stop_strings + 1))),
            ("stop_too_long", "stop", g(stop=["x" * (L.max_stop_string_length + 1)])),
            ("stop_empty", "stop", g(stop=[""])),
            ("stop_token_ids_negative", "stop_token_ids", g(stop_token_ids=[-5])),
            ("stop_token_ids_vocab", "stop_token_ids", g(stop_token_ids=[V])),
            ("request_id_long", "request_id", g(request_id="r" * 100_000)),
            ("utf8_prompt", "prompt", raw(0x12, bad_utf8, prompt=None)),  # field 2, length-delimited
            ("utf8_stop", "stop", raw(0x32, bad_utf8)),  # field 6
            ("utf8_request_id", "request_id", raw(0x0A, bad_utf8, request_id="")),  # field 1
            ("utf8_tokenize", "text", b"\x0a" + bytes([len(bad_utf8)]) + bad_utf8),  # TokenizeRequest.text
        ]

    async def malformed(self, rng):
        cases = self._malformed_cases()
        name, field, req = cases[self._malformed_next % len(cases)]
        self._malformed_next += 1
        if name == "utf8_tokenize":
            method = self.channel.unary_unary(
                f"/{SERVICE}/Tokenize", response_deserializer=ced_pb2.TokenizeResponse.FromString
            )
            t0 = time.perf_counter()
            res = StreamResult(status="OK")
            try:
                await method(req, timeout=30, metadata=self.metadata)
            except grpc.aio.AioRpcError as e:
                res.status, res.details = e.code().name, e.details() or ""
            res.total_s = time.perf_counter() - t0
        elif isinstance(req, bytes):
            res = await self._stream(None, raw=req)
        else:
            res = await self._stream(req)
        problem = None
        if res.status == "INVALID_ARGUMENT" and field not in res.details:
            problem = f"{name}: INVALID_ARGUMENT does not name {field!r}: {res.details}"
        elif res.status not in FATAL_STATUSES and res.status != "INVALID_ARGUMENT":
            problem = f"{name}: expected INVALID_ARGUMENT naming {field!r}, got {res.answer} {res.details}"
        elif res.status in FATAL_STATUSES:
            problem = f"{name}: {res.status}: {res.details}"
        self._record("malformed", res, {"INVALID_ARGUMENT"}, problem)

    async def deadline(self, rng):
        req = self._request(
            "deadline", self._prompt(rng), max_tokens=rng.randint(1, self.max_tokens), **self._sampling(rng)
        )
        res = await self._stream(req, timeout=rng.choice([0.001, 0.01, 0.05, 0.2, 1.0]))
        allowed = {"DEADLINE_EXCEEDED", "OK/stop", "OK/length", "RESOURCE_EXHAUSTED"}
        self._record("deadline", res, allowed, _check_stream(res, req, self.vocab))

    async def tokenize_big(self, rng):
        size = rng.choice([16 << 10, 256 << 10, 1 << 20, 3 << 20, 6 << 20])
        text = ("soak tokenize héllo 数据 " * (size // 20 + 1))[:size]
        res = StreamResult(status="OK")
        t0 = time.perf_counter()
        try:
            out = await self.stub.Tokenize(
                ced_pb2.TokenizeRequest(text=text), timeout=self.args.request_timeout, metadata=self.metadata
            )
            res.ttft_s = time.perf_counter() - t0
            problem = None if out.token_ids else "Tokenize returned no tokens for a non-empty text"
        except grpc.aio.AioRpcError as e:
            res.status, res.details = e.code().name, e.details() or ""
            problem = None
        res.total_s = time.perf_counter() - t0
        self._record("tokenize_big", res, {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, problem)

    def fixed_request(self) -> ced_pb2.GenerateRequest:
        # Sampled (not greedy), so the check covers the seeded sampler and the prefix cache (the prompt
        # spans two full pages that later copies find cached).
        req = self._request(
            "determinism", self.fixed_prompt, max_tokens=min(12, self.max_tokens * 2, self.limits.max_tokens),
            ignore_eos=True, sampling=ced_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=4242),
        )  # fmt: skip
        return req

    async def determinism(self, rng):
        req = self.fixed_request()
        res = await self._stream(req)
        self._record(
            "determinism", res, {"OK/length", "RESOURCE_EXHAUSTED"}, _check_stream(res, req, self.vocab)
        )
        if res.status == "OK":
            self.fixed_completions.append((res.answer, res.token_ids))

    async def overload(self, rng):
        n = (self.limits.max_running or self.limits.max_slots) + self.limits.max_queued + 8
        reqs = [self._long_request("overload") for _ in range(n)]
        calls = [asyncio.ensure_future(self._stream(r)) for r in reqs]
        # Hold the burst, then cancel whatever still streams or waits.
        done, pending = await asyncio.wait(calls, timeout=self.args.burst_hold)
        for c in pending:
            c.cancel()
        for c, r in zip(calls, reqs, strict=True):
            try:
                res = await c
            except asyncio.CancelledError:
                res = StreamResult(status="CANCELLED", total_s=self.args.burst_hold)
            allowed = {"RESOURCE_EXHAUSTED", "CANCELLED", "OK/length"}
            self._record("overload", res, allowed, _check_stream(res, r, self.vocab))

    # ---- tenant checks (only when the server knows `user`) ----
    async def tenant_checks(self) -> dict:
        out: dict = {}
        prompt = [
            self.rng.randrange(3, self.vocab) for _ in range(min(3 * self.page + 1, self.prompt_budget))
        ]

        async def cached(user: str) -> int | None:
            req = ced_pb2.GenerateRequest(request_id=self._rid("tenant"), max_tokens=1, user=user)
            req.prompt_token_ids.ids.extend(prompt)
            res = await self._stream(req)
            if res.status != "OK":
                return None
            return res.messages[-1].usage.cached_prompt_tokens

        a1, a2, b = await cached(USERS[0]), await cached(USERS[0]), await cached(USERS[1])
        out["prefix_cache"] = {"first": a1, "same_user_again": a2, "other_user": b}
        if a2:  # the prefix cache is on; another user must not see the first user's pages
            out["prefix_cache"]["ok"] = b == 0
        # Request ids are per user: the same id in flight for two users is no duplicate.
        first = self._long_request("tenant")
        first.user = USERS[0]
        second_answer: list[str] = []

        async def same_id_other_user():
            second = ced_pb2.GenerateRequest()
            second.CopyFrom(first)
            second.user, second.max_tokens = USERS[1], 1
            second_answer.append((await self._stream(second)).answer)
            return True

        res = await self._stream(first, on_first=same_id_other_user)
        out["request_id_per_user"] = {"first": res.answer, "other_user_same_id": second_answer}
        if res.status == "CANCELLED":  # the first was in flight while the second ran
            out["request_id_per_user"]["ok"] = second_answer[0] in ("OK/length", "OK/stop")
        if self.abort_has_user:
            req = self._long_request("tenant")
            req.user = USERS[0]
            verdict: dict = {}

            async def cross_abort():
                verdict["other_user_found"] = await self._abort(req.request_id, USERS[1])
                verdict["same_user_found"] = await self._abort(req.request_id, USERS[0])
                return False

            res = await self._stream(req, on_first=cross_abort)
            verdict["stream"] = res.answer
            verdict["ok"] = verdict.get("other_user_found") is False and res.answer in (
                "OK/abort",
                "OK/length",
            )
            out["abort"] = verdict
        return out

    # ---- driver ----
    async def run(self) -> dict:
        args = self.args
        self.channel = grpc.aio.insecure_channel(self.addr)
        self.stub = ced_pb2_grpc.InferenceServiceStub(self.channel)
        gate = asyncio.Semaphore(args.concurrency)
        classes, weights = list(MIX), list(MIX.values())
        bursts = {(k + 1) * args.requests // (args.overload_bursts + 1) for k in range(args.overload_bursts)}
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        sent = 0
        stopped_early = False
        for i in range(args.requests):
            if time.perf_counter() - t0 > args.duration:
                stopped_early = True
                break
            if i in bursts:
                tasks.append(asyncio.ensure_future(self.overload(random.Random(self.rng.random()))))
            cls = (
                classes[i] if i < len(classes) else self.rng.choices(classes, weights)[0]
            )  # each at least once
            await gate.acquire()
            task = asyncio.ensure_future(self._mix_one(cls, random.Random(self.rng.random())))
            task.add_done_callback(lambda _: gate.release())
            tasks.append(task)
            sent += 1
        _, hung = (
            await asyncio.wait(tasks, timeout=args.request_timeout + args.burst_hold + 30)
            if tasks
            else ((), ())
        )
        for t in hung:
            t.cancel()
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
        # After the load: the fixed request twice more, alone, so determinism is always checked.
        for _ in range(2):
            await self.determinism(self.rng)
        tenants = await self.tenant_checks() if self.users and self.metadata is None else None
        wall = time.perf_counter() - t0
        try:
            await self.stub.GetModelInfo(ced_pb2.GetModelInfoRequest(), timeout=30, metadata=self.metadata)
            alive = True
        except grpc.aio.AioRpcError:
            alive = False
        await self.channel.close()
        return {
            "wall_s": wall,
            "mix_requests": sent,
            "stopped_by_duration": stopped_early,
            "hung_tasks": len(hung),
            "client_errors": [f"{type(e).__name__}: {e}" for e in errors],
            "tenants": tenants,
            "server_alive": alive,
        }


def summarize(records: list[Record]) -> dict:
    by_class: dict[str, dict] = {}
    for cls in sorted({r.cls for r in records}, key=lambda c: (CLASSES.index(c.split()[0]), c)):
        rs = [r for r in records if r.cls == cls]
        by_class[cls] = {
            "requests": len(rs),
            "answers": dict(collections.Counter(r.answer for r in rs)),
            "ttft": _percentiles([r.ttft_s for r in rs if r.ttft_s is not None]),
            # Refusals for load answer in milliseconds and would hide the latency of the real answers.
            "total": _percentiles([r.total_s for r in rs if r.answer != "RESOURCE_EXHAUSTED"]),
        }
    return by_class


def _fmt_ms(p: dict) -> str:
    return "-" if p["p50_ms"] is None else f"{p['p50_ms']:.0f} / {p['p99_ms']:.0f}"


def print_report(result: dict, out=None) -> None:
    out = out or sys.stdout  # looked up now, not at import (a test may have replaced it)
    w = lambda s="": print(s, file=out)  # noqa: E731
    by_class = result["classes"]
    answers = sorted(
        {a for c in by_class.values() for a in c["answers"]}, key=lambda a: (not a.startswith("OK"), a)
    )
    w(
        f"# bench/soak.py against {result['addr']}: {result['requests']} requests "
        f"({result['run']['mix_requests']} in the mix, the rest in overload bursts), concurrency "
        f"{result['concurrency']}, {result['run']['wall_s']:.0f} s; user field: "
        f"{'yes' if result['users'] else 'no'}"
    )
    w("| class | requests | " + " | ".join(answers) + " | TTFT p50 / p99 ms | total p50 / p99 ms |")
    w("|---" * (len(answers) + 4) + "|")
    for cls, c in by_class.items():
        cells = " | ".join(str(c["answers"].get(a, 0)) for a in answers)
        w(f"| {cls} | {c['requests']} | {cells} | {_fmt_ms(c['ttft'])} | {_fmt_ms(c['total'])} |")
    w()
    mix = [c for cls, c in by_class.items() if cls != "overload"]
    refused = sum(c["answers"].get("RESOURCE_EXHAUSTED", 0) for c in mix)
    # Many refusals mean the soak mostly measured admission control: raise --max-queued or lower C.
    w(f"mix requests refused RESOURCE_EXHAUSTED: {refused} of {sum(c['requests'] for c in mix)}")
    leak = result["leak"]
    if leak is None:
        w("leaks: not checked (no --metrics)")
    else:
        w(f"after the soak: {leak['after']}  -> {'no leak' if leak['ok'] else 'LEAK'}")
    rss = result["rss_bytes"]
    if rss["before"] is not None and rss["after"] is not None:
        w(f"server RSS: {rss['before'] / 2**20:.0f} MiB before, {rss['after'] / 2**20:.0f} MiB after "
          f"({(rss['after'] - rss['before']) / 2**20:+.0f} MiB)")  # fmt: skip
    else:
        w("server RSS: unknown (give --pid, or a server that exports process_resident_memory_bytes)")
    d = result["determinism"]
    w(f"determinism: {d['completions']} completions of the fixed seeded request, "
      f"{d['distinct']} distinct -> {'ok' if d['ok'] else 'FAILED'}")  # fmt: skip
    if result["run"]["tenants"] is not None:
        w(f"tenant checks: {result['run']['tenants']}")
    if result.get("tenant_phase") is not None:
        soak_tenants.print_report(result["tenant_phase"], w)
    for p in result["problems"][:30]:
        w(f"problem: {p}")
    if len(result["problems"]) > 30:
        w(f"... and {len(result['problems']) - 30} more problems")
    w("verdict: " + ("PASS" if result["ok"] else "FAIL: " + "; ".join(result["failures"])))


def _server_fields(addr: str) -> tuple[bool, bool]:
    """Whether the server's GenerateRequest / AbortRequest have a `user` field (its own descriptor)."""
    local = ced_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    local_abort = ced_pb2.AbortRequest.DESCRIPTOR.fields_by_name
    with grpc.insecure_channel(addr) as ch:
        try:
            fd = ProtoReflectionDescriptorDatabase(ch).FindFileContainingSymbol(
                f"{SERVICE.rsplit('.', 1)[0]}.GenerateRequest"
            )
            fields = {m.name: {f.name for f in m.field} for m in fd.message_type}
        except (grpc.RpcError, KeyError):
            # No reflection: trust our own copy of the proto.
            fields = {"GenerateRequest": set(local), "AbortRequest": set(local_abort)}
    gen = "user" in fields.get("GenerateRequest", ()) and "user" in local
    abort = "user" in fields.get("AbortRequest", ()) and "user" in local_abort
    return gen, abort


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/soak.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("addr", help="HOST:PORT of the server (loopback only)")
    p.add_argument("--metrics", help="HOST:PORT of the server's Prometheus endpoint (loopback only)")
    p.add_argument("--pid", type=int, help="the server's process id (RSS from /proc/PID/status)")
    p.add_argument("--requests", type=int, default=400, help="requests in the mix (bursts come on top)")
    p.add_argument("--concurrency", type=int, default=48, help="streams open at once (bursts come on top)")
    p.add_argument(
        "--duration", type=float, default=600.0, help="stop sending new requests after this many s"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of ordinary requests")
    p.add_argument("--overload-bursts", type=int, default=2)
    p.add_argument("--burst-hold", type=float, default=3.0, help="s a burst is held before it is cancelled")
    p.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline of ordinary calls, s")
    p.add_argument("--settle", type=float, default=30.0, help="s to wait for the server to go idle after")
    p.add_argument("--api-key", help="sent as `authorization: Bearer KEY` (a server started with API keys)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here ('-': JSON on stdout instead of the table)")
    soak_tenants.add_arguments(p)
    args = p.parse_args(argv)
    for name in ("requests", "concurrency"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("duration", "request_timeout", "burst_hold", "settle"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.overload_bursts < 0 or args.max_tokens < 1:
        raise UsageError("--overload-bursts must be >= 0 and --max-tokens >= 1")
    loopback_address(args.addr, "addr")
    if args.metrics:
        loopback_address(args.metrics, "--metrics")
    if args.pid is not None and not Path(f"/proc/{args.pid}/status").exists():
        raise UsageError(f"--pid: no process {args.pid}")
    if args.http or args.victim_key:
        if not (args.http and args.victim_key and args.api_key):
            raise UsageError("the tenant phase needs --http, --api-key (the attacker) and --victim-key")
        if args.victim_key == args.api_key:
            raise UsageError("--victim-key must be another tenant's key than --api-key")
        loopback_address(args.http, "--http")
        if not args.tenant_s > 0 or args.attackers < 1 or args.big_bytes < 1024:
            raise UsageError("--tenant-s must be > 0, --attackers >= 1 and --big-bytes >= 1024")
        unknown = set((args.tenant_classes or "").split(",")) - set(soak_tenants.ACCEPT) - {""}
        if unknown:
            raise UsageError(f"--tenant-classes: unknown {sorted(unknown)}; known: {list(soak_tenants.ACCEPT)}")
        if not 0 <= args.slow_image_port < 65536:
            raise UsageError(f"--slow-image-port must be a port number, got {args.slow_image_port}")
    return args


def _wait_idle(metrics_addr: str, num_pages: int, settle_s: float) -> dict:
    """Polls /metrics until nothing holds a page, slot or queue place (or settle_s passes)."""
    end = time.monotonic() + settle_s
    while True:
        m = scrape(metrics_addr)
        after = {
            k: m.get(k)
            for k in (*LEAK_GAUGES, "ced_kv_pages_free", "ced_kv_pages_cached", "ced_compiles_after_warmup")
        }
        idle = all(after[k] == 0 for k in LEAK_GAUGES)
        pages = after["ced_kv_pages_used"] + after["ced_kv_pages_free"] + after["ced_kv_pages_cached"]
        accounted = pages == num_pages
        if (idle and accounted) or time.monotonic() > end:
            return {"after": after, "ok": idle and accounted, "pages_accounted": accounted, "metrics": m}
        time.sleep(0.2)


def run(argv=None) -> tuple[int, dict | None]:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"bench/soak.py: error: {e}", file=sys.stderr)
        return 2, None
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    with grpc.insecure_channel(args.addr) as channel:
        info = ced_pb2_grpc.InferenceServiceStub(channel).GetModelInfo(
            ced_pb2.GetModelInfoRequest(), timeout=30, metadata=metadata
        )
    has_user, abort_has_user = _server_fields(args.addr)
    before_metrics = scrape(args.metrics) if args.metrics else None
    rss_before = rss_bytes(args.pid, before_metrics)
    soak = Soak(args, info, USERS if has_user else (), abort_has_user)
    run_info = asyncio.run(soak.run())
    tenant_phase = None  # before the leak check: its requests must leave nothing held either
    if args.http:
        host, port = loopback_address(args.http, "--http")
        base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        tenant_phase = asyncio.run(soak_tenants.TenantPhase(args, args.addr, base).run())
    leak = None
    after_metrics = None
    if args.metrics:
        leak = _wait_idle(args.metrics, info.num_pages, args.settle)
        after_metrics = leak.pop("metrics")
    rss_after = rss_bytes(args.pid, after_metrics)
    completions = [tuple(t) for _, t in soak.fixed_completions]
    determinism = {
        "completions": len(completions),
        "distinct": len(set(completions)),
        "ok": len(completions) >= 2 and len(set(completions)) == 1,
    }
    problems = [f"{r.cls}: {r.problem}" for r in soak.records if r.problem]
    failures = []
    if tenant_phase is not None:
        failures += [f"tenant phase: {f}" for f in tenant_phase["failures"]]
    fatal = sum(r.answer in FATAL_STATUSES for r in soak.records)
    if fatal:
        failures.append(f"{fatal} answers were UNKNOWN/INTERNAL")
    if len(problems) > fatal:
        failures.append(f"{len(problems) - fatal} other unacceptable answers")
    if leak is not None and not leak["ok"]:
        failures.append(f"pages/slots not released: {leak['after']}")
    if not determinism["ok"]:
        failures.append("determinism")
    if run_info["hung_tasks"] or run_info["client_errors"]:
        failures.append(f"{run_info['hung_tasks']} hung requests, client errors {run_info['client_errors']}")
    if not run_info["server_alive"]:
        failures.append("the server stopped answering")
    tenants = run_info["tenants"] or {}
    for name, check in tenants.items():
        if check.get("ok") is False:
            failures.append(f"tenant isolation ({name}): {check}")
    missing = [c for c in CLASSES if not any(r.cls.split()[0] == c for r in soak.records)]
    result = {
        "addr": args.addr,
        "concurrency": args.concurrency,
        "requests": len(soak.records),
        "users": bool(soak.users),
        "classes": summarize(soak.records),
        "classes_missing": missing,
        "leak": leak,
        "rss_bytes": {"before": rss_before, "after": rss_after},
        "determinism": determinism,
        "problems": problems,
        "run": run_info,
        "tenant_phase": tenant_phase,
        "failures": failures,
        "ok": not failures,
    }
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    return (0 if result["ok"] else 1), result


def main(argv=None) -> int:
    return run(argv)[0]


if __name__ == "__main__":
    sys.exit(main())
