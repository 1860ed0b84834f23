"""`JaxEngine` on a device mesh (what `ced-jax serve --mesh` runs): 8 fake CPU devices, (1, 4, 2) and
(2, 2, 2) with the EP+TP rules, against the same engine on one device.

Free-running greedy tokens and log-probabilities must be identical: on these meshes the model is
bit-identical to one device in mode A (tests/ced_jax/test_sharding.py), so any difference here is
the engine's (cache layout, donation, slot views). Slow: each engine compiles its own programs.
"""

from __future__ import annotations

import numpy as np
import pytest
from serving_helpers import ServerThread

import ced_jax
from ced_jax import sharding
from serving import client
from serving.config import ServeConfig
from serving.jax_engine import JaxEngine, ModelTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SLOTS, PAGE, CONTEXT, CHUNK = 4, 16, 64, 32
PROMPTS = [[0, *range(40, 77)], [0, 5, 9, 200, 300, 17], [0, *range(300, 320)]]


def _serve_all(mesh) -> list:
    model = ced_jax.load("tiny", mesh=mesh)
    engine = JaxEngine(model, max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_chunk=CHUNK)
    engine.warmup()  # minutes on CPU: before the server thread, whose start waits 30 s at most
    config = ServeConfig(
        max_slots=SLOTS, page_size=PAGE, num_pages=SLOTS * CONTEXT // PAGE, max_context=CONTEXT,
        prefill_buckets=(CHUNK,), max_tokens_limit=32, default_max_tokens=8, metrics_port=None,
    )  # fmt: skip
    st = ServerThread(engine, ModelTokenizer(model), config)
    try:
        outs = []
        for p in PROMPTS:
            out = client.generate(st.addr, p, max_tokens=10, temperature=0.0, logprobs=4, ignore_eos=True,
                                  timeout=600)  # fmt: skip
            outs.append((out.token_ids, [[(t.token_id, t.logprob) for t in lp.top] for lp in out.logprobs]))
        # A prefix hit on the mesh too (the first prompt's two full pages).
        hit = client.generate(st.addr, PROMPTS[0], max_tokens=10, temperature=0.0, logprobs=4,
                              ignore_eos=True, timeout=600)  # fmt: skip
        assert hit.usage.cached_prompt_tokens == 32
        assert hit.token_ids == outs[0][0]
        assert engine.compiles_after_warmup == 0
        st.assert_idle()
    finally:
        st.close()
    return outs


@pytest.fixture(scope="module")
def single():
    return _serve_all(None)


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2)])
def test_engine_on_a_mesh_equals_one_device(single, shape):
    d, e, t = shape
    got = _serve_all(sharding.make_mesh({"data": d, "expert": e, "tensor": t}))
    for (ids, lps), (want_ids, want_lps) in zip(got, single, strict=True):
        assert ids == want_ids
        np.testing.assert_array_equal(np.asarray(lps), np.asarray(want_lps))
