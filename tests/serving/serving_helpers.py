"""Shared helpers for serving tests: a small mock engine with a matching ServeConfig, a scheduler driver.

Imported by name (pytest puts tests/serving on sys.path), so test modules share it without conftest magic.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from serving.config import ServeConfig
from serving.engine.protocol import SamplingParams
from serving.requests import GenerationRequest
from serving.scheduling.scheduler import Scheduler
from serving.server import Server
from serving.testing.mock_engine import ByteTokenizer, MockEngine

GREEDY = SamplingParams(temperature=0.0)


def make_engine_and_config(**overrides) -> tuple[MockEngine, ServeConfig]:
    """A MockEngine and a ServeConfig with the same shapes; overrides go to whichever knows the key."""
    shapes = dict(max_slots=4, page_size=4, num_pages=64, max_context=64, prefill_buckets=(4, 8, 16))
    engine_only = {"rule", "replay_tokens", "history_tokens", "step_delay_s", "ced_window", "vocab_size"}
    for k in list(overrides):
        if k in shapes:
            shapes[k] = overrides.pop(k)
    engine_kw = {k: overrides.pop(k) for k in list(overrides) if k in engine_only}
    if "long_prefill_chunk" in overrides:  # both know it
        engine_kw["long_prefill_chunk"] = overrides["long_prefill_chunk"]
    engine = MockEngine(**shapes, max_logprobs=5, **engine_kw)
    cfg = dict(max_logprobs=5, max_tokens_limit=60, default_max_tokens=16, max_queued=8, metrics_port=None)
    cfg.update(overrides)
    engine.warmup()
    return engine, ServeConfig(**shapes, **cfg)


def request(rid: str, prompt, **kw) -> GenerationRequest:
    if isinstance(prompt, str):
        prompt = ByteTokenizer().encode(prompt)
    kw.setdefault("sampling", GREEDY)
    return GenerationRequest(request_id=rid, prompt_token_ids=tuple(prompt), **kw)


def run_until_idle(sched: Scheduler, max_steps: int = 10_000) -> int:
    for i in range(max_steps):
        if not sched.step():
            return i
    raise AssertionError("scheduler did not go idle")


def wait_until(cond, timeout: float = 10.0, interval: float = 0.01) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


class ServerThread:
    """A serving.server.Server on its own event loop thread, so tests can use blocking gRPC clients."""

    def __init__(self, engine, tokenizer, config):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()
        self.server = self.call(self._make(config))
        self.call(self.server.start(engine, tokenizer))
        self.addr = self.server.address
        self.scheduler = self.server.scheduler

    @staticmethod
    async def _make(config):
        return Server(config)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, grace_period_s: float = 0.0) -> None:
        self.call(self.server.shutdown(grace_period_s))
        self.stop_loop()

    def stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def assert_idle(self, timeout: float = 5.0) -> None:
        """Eventually no request holds a slot or a page."""
        s = self.scheduler
        wait_until(
            lambda: s.num_in_flight == 0 and s.num_running == 0 and s.pool.num_referenced == 0, timeout
        )
        s.pool.check_invariants()


def http_converter(tokenizer_json, *, max_tokens_limit: int = 64, max_context: int = 4096):
    """The HTTP API's request converter (no engine) over a tokenizer.json, with the default model names."""
    import tokenizers

    from serving.http.convert import Converter
    from serving.model_names import ModelCatalog

    return Converter(
        tokenizers.Tokenizer.from_file(str(tokenizer_json)), catalog=ModelCatalog(ServeConfig().http_models),
        max_context=max_context, max_tokens_limit=max_tokens_limit, max_logprobs=5,
    )  # fmt: skip


TINY_V = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"


class GoldenTokenizer:
    """The serving tokenizer interface over tiny-v's tokenizer.json (the mock engine needs no model)."""

    tokenizer_file = TINY_V / "tokenizer.json"

    def __init__(self):
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(str(self.tokenizer_file))

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode(list(ids))

    def constraint_tokenizer(self):
        return None
