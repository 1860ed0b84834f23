"""The HTTP listener's life in `serving.server.Server`, without a model: bound by `bind` (a busy port
fails naming --http-port), 503 in each API's error format while warming up, gone after shutdown."""

from __future__ import annotations

import asyncio
import socket

import httpx2 as httpx
import pytest
from serving_helpers import make_engine_and_config

from serving.server import PortUnavailable, Server


def test_warming_up_answers_503_and_shutdown_closes_the_port():
    async def run():
        _, config = make_engine_and_config(http_port=0, port=0)
        server = Server(config)
        await server.bind()
        base = f"http://127.0.0.1:{server.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            health = await c.get("/health")
            chat = await c.post("/v1/chat/completions", json={"model": "deepseek-flash", "messages": []})
            msgs = await c.post("/anthropic/v1/messages", json={"model": "deepseek-flash", "messages": []})
        port = server.http_port
        await server.shutdown(grace_period_s=0.0)
        return port, health, chat, msgs

    port, health, chat, msgs = asyncio.run(run())
    assert health.status_code == 503
    assert chat.status_code == 503 and "warming up" in chat.json()["error"]["message"]
    assert chat.headers["retry-after"]
    assert msgs.status_code == 503 and msgs.json()["type"] == "error"
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_busy_http_port_fails_at_bind_naming_the_option():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        _, config = make_engine_and_config(http_port=port, port=0)

        async def run():
            await Server(config).bind()

        with pytest.raises(PortUnavailable, match="--http-port"):
            asyncio.run(run())
