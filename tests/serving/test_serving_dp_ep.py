"""Data-parallel attention + EP (`dp_ep`) in the server: `JaxEngine` on 8 fake CPU devices, each
device serving its own slots from its own block of pages, against the same server on one device.

Fast tests check the host side (the block-aware page pool, row placement); the slow one serves
concurrent requests over gRPC on (2, 2, 2) and on one device and compares greedy tokens and
log-probabilities, a prefix hit included.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from serving_helpers import ServerThread

import ced_jax
from ced_jax import sharding
from serving import client
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer
from serving.scheduling.pages import OutOfPages, PagePool

SLOTS, PAGE, CONTEXT, CHUNK = 8, 16, 64, 32
PROMPTS = [
    [0, *range(40, 77)],
    [0, 5, 9, 200, 300, 17],
    [0, *range(300, 320)],
    [0, 11, 12, 13],
    [0, *range(100, 150)],
    [0, 7, 7, 7, 7, 7, 7, 7, 7],
]
LOGPROB_ATOL = 1e-4


def test_a_blocked_pool_allocates_and_evicts_within_the_named_block():
    pool = PagePool(8, PAGE, blocks=2)
    assert pool.allocate(3, block=1) == [4, 5, 6]
    assert pool.allocate(1, block=0) == [0]
    assert pool.num_available_in(1) == 1 and pool.num_available_in(0) == 3
    with pytest.raises(ValueError, match="name the block"):
        pool.allocate(1)
    with pytest.raises(OutOfPages, match="in block 1"):
        pool.allocate(2, block=1)
    # A cached page of block 0 is evicted only for an allocation in block 0.
    pages = pool.allocate(1, block=0)
    pool.register(b"\x00" * 16, np.arange(PAGE), pages[0])
    pool.release(pages)
    assert pool.num_cached == 1
    pool.allocate(1, block=1)
    assert pool.num_cached == 1 and pool.evictions == 0
    assert pool.allocate(2, block=0) == [2, 3]
    pool.allocate(1, block=0)
    assert pool.num_cached == 0 and pool.evictions == 1
    pool.check_invariants()


@pytest.fixture(scope="module")
def dp_model():
    return ced_jax.load("tiny", mesh=sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2}), rules="dp_ep")


def test_sizes_that_do_not_divide_over_the_devices_are_refused(dp_model):
    config = ServeConfig(max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,),
                         decode_buckets=(4, 8), batch_invariant=False, metrics_port=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"decode_buckets \[4, 8\].*multiple of the 8 devices"):
        JaxEngine(dp_model, config)


def _serve(model, prompts) -> tuple[list, JaxEngine]:
    config = ServeConfig(
        max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,), max_tokens_limit=32,
        default_max_tokens=8, metrics_port=None,
        decode_buckets=(8,), prefill_rows=(8,),
    )  # fmt: skip
    engine = JaxEngine(model, config)
    engine.warmup()
    st = ServerThread(engine, ModelTokenizer(model), config)

    def one(p):
        out = client.generate(
            st.addr, p, max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True, timeout=600
        )
        return out.token_ids, [lp.logprob for lp in out.logprobs], out.usage.cached_prompt_tokens

    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(one, prompts))
        hit = one(prompts[0])  # the first prompt's two full pages, from the block that holds them
        assert hit[2] == 32 and hit[0] == outs[0][0]
        assert engine.compiles_after_warmup == 0
        st.assert_idle()
    finally:
        st.close()
    return outs, engine


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dp_ep_server_gives_the_tokens_of_one_device(dp_model):
    dp_outs, dp_engine = _serve(dp_model, PROMPTS)
    assert dp_engine.kv_blocks == 8
    # The requests ran on several devices' blocks (the scheduler spreads them by free pages).
    assert len({b for b in dp_engine.blocks_used}) > 1
    one_outs, _ = _serve(ced_jax.load("tiny"), PROMPTS)
    for (ids, lps, _), (want_ids, want_lps, _) in zip(dp_outs, one_outs, strict=True):
        assert ids == want_ids
        np.testing.assert_allclose(lps, want_lps, rtol=0, atol=LOGPROB_ATOL)
