"""The engine contract: EngineSpec/ServeConfig checks, the compile counter, the mock's strictness, stubs."""

import subprocess
import threading

import jax
import numpy as np
import pytest

from ced_jax.engine import SamplingBatch
from serving.config import ServeConfig
from serving.engine.protocol import (
    CompileCounter,
    DecodeBatch,
    EngineProtocol,
    EngineSpec,
    PrefillChunk,
    SamplingParams,
)
from serving.testing.mock_engine import MockEngine

pytestmark = pytest.mark.timeout(60)


def _spec(**kw):
    base = dict(
        max_slots=2, page_size=4, num_pages=8, max_context=16, prefill_buckets=(4, 8),
        vocab_size=10, eos_token_ids=(1,), max_logprobs=2,
    )  # fmt: skip
    base.update(kw)
    return EngineSpec(**base)


def test_engine_spec_validation_and_buckets():
    spec = _spec()
    assert spec.pages_per_slot == 4 and spec.max_chunk == 8
    assert [spec.bucket_for(n) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    with pytest.raises(ValueError):
        spec.bucket_for(9)
    for bad in (
        dict(max_context=10),
        dict(prefill_buckets=(8, 4)),
        dict(prefill_buckets=(6,)),
        dict(replay_tokens=6),  # not a whole number of pages
        dict(replay_tokens=-4),
    ):
        with pytest.raises(ValueError):
            _spec(**bad)


def test_batch_invariance_is_a_checked_choice():
    on, off = ServeConfig(max_slots=32), ServeConfig(max_slots=32, batch_invariant=False)
    assert (on.decode_buckets, on.prefill_rows) == ((8, 16, 32), (4,))
    assert (off.decode_buckets, off.prefill_rows) == ((1, 2, 4, 8, 16, 32), (1, 4))
    assert ServeConfig(max_slots=4).decode_buckets == (4,)  # fewer slots than 8: all of them
    with pytest.raises(
        ValueError, match=r"decode_buckets \[4, 8\]: batches below 8 rows break batch invariance"
    ):
        ServeConfig(max_slots=8, decode_buckets=(4, 8))
    with pytest.raises(
        ValueError, match=r"prefill_rows \(--prefill-rows\) \[2, 4\]: several prefill sizes break"
    ):
        ServeConfig(prefill_rows=(2, 4))
    assert ServeConfig(max_slots=8, decode_buckets=(4, 8), prefill_rows=(2, 4), batch_invariant=False)


def test_serve_config_validation_and_engine_check():
    with pytest.raises(ValueError, match="multiple of page_size"):
        ServeConfig(page_size=64, max_context=100)
    with pytest.raises(ValueError, match="num_pages"):
        ServeConfig(num_pages=10)
    with pytest.raises(ValueError, match="max_running"):
        ServeConfig(max_slots=4, max_running=5)
    cfg = ServeConfig(
        max_slots=2, page_size=4, num_pages=8, max_context=16, prefill_buckets=(4, 8), max_logprobs=2
    )
    cfg.check_engine(_spec())
    with pytest.raises(ValueError, match="num_pages"):
        cfg.check_engine(_spec(num_pages=9))
    with pytest.raises(ValueError, match="max_logprobs"):
        cfg.check_engine(_spec(max_logprobs=1))
    assert cfg.running_limit == 2


def test_compile_counter_counts_only_watched_calls_on_this_thread():
    counter = CompileCounter()
    f = jax.jit(lambda x: x * 3 + 1)
    x3, x5, x7 = np.zeros(3), np.zeros(5), np.zeros(7)
    f(x3)  # not watched
    with counter.watch():
        f(x3)  # cached: no compile
        assert counter.count == 0
        f(x5)  # new shape: compiles
    assert counter.count == 1
    t = threading.Thread(target=lambda: f(x7))
    with counter.watch():
        t.start()
        t.join()
    assert counter.count == 1


def test_mock_engine_is_an_engine_and_counts_new_shapes():
    engine = MockEngine(max_slots=2, page_size=4, num_pages=8, max_context=16, prefill_buckets=(4, 8))
    assert isinstance(engine, EngineProtocol)
    engine.warmup()
    assert engine.compiles_after_warmup == 0
    # a shape warm-up did not cover (3 rows) is a compile after warm-up
    rows = SamplingBatch.broadcast(3, token_bitmask=engine._all_ones(3))
    engine._sample(np.zeros((3, engine.spec.vocab_size), np.float32), np.zeros(3, np.int32), rows)
    assert engine.compiles_after_warmup == 1


def test_mock_engine_enforces_the_contract():
    engine = MockEngine(
        max_slots=2, page_size=4, num_pages=8, max_context=16, prefill_buckets=(4, 8), replay_tokens=4
    )
    engine.warmup()
    pt = np.arange(4, dtype=np.int32)
    greedy = SamplingParams(temperature=0.0)

    def chunk(start, n, **kw):
        kw.setdefault("is_last_chunk", False)
        kw.setdefault("token_ids", np.full(n, 5, np.int32))
        return PrefillChunk(slot=0, start_pos=start, page_table=pt,
                            history=np.zeros(0, np.int32), sampling=greedy, **kw)  # fmt: skip

    with pytest.raises(ValueError, match="page aligned"):
        engine.prefill(chunk(2, 4))
    with pytest.raises(ValueError, match="outside"):
        engine.prefill(chunk(0, 9))
    with pytest.raises(ValueError, match="starts at its window_floor"):
        engine.prefill(chunk(4, 4))  # resuming a fresh slot mid-sequence without a replay
    res = engine.prefill(chunk(0, 8))
    assert res.token is None
    with pytest.raises(ValueError, match="state is at 8"):
        engine.prefill(chunk(4, 4))
    batch = DecodeBatch(
        active=np.array([True, False]), token_ids=np.zeros(2, np.int32), positions=np.array([8, 0], np.int32),
        page_tables=np.stack([pt, pt]), sampling=SamplingBatch.broadcast(2),
    )  # fmt: skip
    with pytest.raises(ValueError, match="has not finished prefill"):
        engine.decode(batch)
    engine.release(0)
    # A prefix hit at 8 replayed from 4: the replayed tokens must be the cached pages'.
    with pytest.raises(ValueError, match="differ from the cached pages"):
        engine.prefill(chunk(4, 8, window_floor=4, write_from=8, token_ids=np.full(8, 6, np.int32)))
    engine.prefill(chunk(4, 8, window_floor=4, write_from=8, is_last_chunk=True))


def test_stubs_are_generated_package_relative_and_ignored():
    from serving import proto

    proto.generate_stubs(force=True)
    grpc_src = (proto._HERE / "ced_pb2_grpc.py").read_text()
    assert "from serving.proto import ced_pb2" in grpc_src
    assert "\nimport ced_pb2" not in grpc_src
    out = subprocess.run(
        ["git", "check-ignore", "serving/proto/ced_pb2.py", "serving/proto/ced_pb2_grpc.py"],
        cwd=proto._ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0 and len(out.stdout.split()) == 2
