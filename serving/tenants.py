"""Who a call acts for: API keys, the identity derived from them, and the gRPC gate that checks them.

Identity. Every request carries one: with API keys configured (`ced-jax serve --api-key-file`), it is
the name of the key the call presented; without keys, it is the request's `user` field (a claim, not a
proof: it separates cooperating clients, as the hosted APIs' `user` does, but anyone may claim any
user), or "" (anonymous). The scheduler keys request ids by (identity, request_id) and, unless the
prefix cache is shared, scopes the prefix cache by identity (`serving/scheduling/pages.py`).

Keys are never kept, logged or exported: `ApiKeys` holds SHA-256 digests of the keys and their names,
and a key without a name is known by a hash prefix. A presented key is hashed and compared with every
configured digest in constant time (`hmac.compare_digest`, no early exit), so the time taken does not
depend on how much of a key was right or which key matched.

Key file: one key per line, optionally followed by a name (`KEY NAME`); blank lines and lines starting
with `#` are ignored. Keys are printable ASCII without spaces (gRPC metadata values). Two keys may share
a name (rotation: both act as the same tenant); the same key twice is an error.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence

import grpc

# Services anyone may call without a key: load balancers probe health, and reflection only describes
# the API. Everything else (ced.v1 and any service added later) needs a key when keys are configured.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})

_MISSING = "missing API key: send metadata 'authorization: Bearer <key>' or 'x-api-key: <key>'"


class Unauthenticated(Exception):
    """The call presented no valid API key (UNAUTHENTICATED); the message never contains the key."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("ascii")).digest()


class ApiKeys:
    """The configured keys, as (SHA-256 digest, identity name) pairs."""

    def __init__(self, entries: Sequence[tuple[bytes, str]]):
        if not entries:
            raise ValueError("no API keys")
        self._entries = tuple(entries)

    def __repr__(self) -> str:  # no digests: a config printed in a log should not help guess a key
        return f"ApiKeys({len(self._entries)} keys)"

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for _, name in self._entries)

    @classmethod
    def parse(cls, lines: Iterable[str], source: str = "api key file") -> ApiKeys:
        """Keys from the lines of a key file; ValueError names the source and line (never the key)."""
        entries: list[tuple[bytes, str]] = []
        seen: dict[bytes, int] = {}
        for lineno, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) > 2:
                raise ValueError(
                    f"{source} line {lineno}: expected 'KEY' or 'KEY NAME', got {len(fields)} fields"
                )
            key = fields[0]
            if not (key.isascii() and key.isprintable()):
                raise ValueError(f"{source} line {lineno}: a key must be printable ASCII (gRPC metadata)")
            digest = _digest(key)
            if digest in seen:
                raise ValueError(f"{source} line {lineno}: the same key is already on line {seen[digest]}")
            seen[digest] = lineno
            # An unnamed key is known by a hash prefix, so logs and metrics can tell tenants apart
            # without ever showing the key.
            name = fields[1] if len(fields) == 2 else f"key-{digest.hex()[:16]}"
            entries.append((digest, name))
        if not entries:
            raise ValueError(f"{source} has no keys")
        return cls(entries)

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        """Reads a key file; a missing, unreadable or empty file is a ValueError naming `path`."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None
        return cls.parse(lines, source=path)

    def identify(self, key: str) -> str | None:
        """The identity of `key`, or None if it is not configured."""
        if not (key.isascii() and key.isprintable()):
            return None
        digest = _digest(key)
        found = None
        for known, name in self._entries:  # every entry, no early exit: constant time in the match
            if hmac.compare_digest(known, digest):
                found = name
        return found

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The identity of the key in a call's metadata; raises Unauthenticated."""
        bearer = header = None
        for name, value in metadata or ():
            if not isinstance(value, str):
                continue
            if name == "authorization":
                scheme, _, token = value.strip().partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    raise Unauthenticated("authorization: expected 'Bearer <key>'")
                bearer = token.strip()
            elif name == "x-api-key":
                header = value.strip()
        if bearer is not None and header is not None and bearer != header:
            raise Unauthenticated("the authorization and x-api-key metadata name different keys")
        key = bearer if bearer is not None else header
        if not key:
            raise Unauthenticated(_MISSING)
        identity = self.identify(key)
        if identity is None:
            raise Unauthenticated("invalid API key")
        return identity


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call outside OPEN_SERVICES that does not present a configured key."""

    def __init__(self, keys: ApiKeys):
        self._keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        try:
            self._keys.authenticate(handler_call_details.invocation_metadata)
        except Unauthenticated as e:
            return _refusal(handler, str(e))
        return handler


def server_interceptors(keys: ApiKeys | None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a server needs for `keys` (none without keys)."""
    return [] if keys is None else [ApiKeyInterceptor(keys)]
