"""Shared helpers for serving tests: a small mock engine with a matching ServeConfig, a scheduler driver.

Imported by name (pytest puts tests/serving on sys.path), so test modules share it without conftest magic.
"""

from __future__ import annotations

from serving.config import ServeConfig
from serving.engine_api import SamplingParams
from serving.mock_engine import ByteTokenizer, MockEngine
from serving.scheduler import GenerationRequest, Scheduler

GREEDY = SamplingParams(temperature=0.0)


def make_engine_and_config(**overrides) -> tuple[MockEngine, ServeConfig]:
    """A MockEngine and a ServeConfig with the same shapes; overrides go to whichever knows the key."""
    shapes = dict(max_slots=4, page_size=4, num_pages=64, max_context=64, prefill_buckets=(4, 8, 16))
    engine_only = {"rule", "restore_mode", "snapshot_chunk_end_only", "history_tokens", "step_delay_s"}
    for k in list(overrides):
        if k in shapes:
            shapes[k] = overrides.pop(k)
    engine_kw = {k: overrides.pop(k) for k in list(overrides) if k in engine_only}
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
