"""`JaxEngine` on a device mesh (what `ced-jax serve --mesh` runs): 8 fake CPU devices, (1, 4, 2) and
(2, 2, 2) with the EP+TP rules, against the same engine on one device.

Each engine is checked against the dense `ced_jax.api.Session` on the same mesh with the engine's
shapes (as test_serving_jax.py does on one device): the same greedy tokens, log-probabilities within
a few ulps. Free-running comparison across meshes is not exact: the vocabulary and the attention
heads are split over `tensor`, so sums run in another order, and the chaotic tiny model turns that
into different logits within a few tokens (measured: greedy tokens the same, the chosen token's
log-probability 0.07 apart by step 8); the model itself is held to one device in mode A by
tests/ced_jax/test_sharding.py. Slow: each mesh compiles its own programs.
"""

from __future__ import annotations

import numpy as np
import pytest
from serving_helpers import ServerThread
from test_serving_jax import mirror

import ced_jax
from ced_jax import sharding
from serving import client
from serving.config import ServeConfig
from serving.engine.jax_engine import JaxEngine, ModelTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SLOTS, PAGE, CONTEXT, CHUNK = 4, 16, 64, 32
LOGPROB_ATOL = 4e-6
PROMPTS = [[0, *range(40, 77)], [0, 5, 9, 200, 300, 17], [0, *range(300, 320)]]


def _serve_all(mesh) -> list:
    model = ced_jax.load("tiny", mesh=mesh)
    config = ServeConfig(
        max_slots=SLOTS, page_size=PAGE, max_context=CONTEXT, prefill_buckets=(CHUNK,), max_tokens_limit=32,
        default_max_tokens=8, metrics_port=None,
    )  # fmt: skip
    engine = JaxEngine(model, config)
    engine.warmup()  # minutes on CPU: before the server thread, whose start waits 30 s at most
    st = ServerThread(engine, ModelTokenizer(model), config)
    try:
        outs = []
        for p in PROMPTS:
            out = client.generate(st.addr, p, max_tokens=10, temperature=0.0, logprobs=4, ignore_eos=True,
                                  timeout=600)  # fmt: skip
            outs.append((p, out.token_ids, [lp.logprob for lp in out.logprobs]))
        # A prefix hit on the mesh too (the first prompt's two full pages).
        hit = client.generate(st.addr, PROMPTS[0], max_tokens=10, temperature=0.0, logprobs=4,
                              ignore_eos=True, timeout=600)  # fmt: skip
        assert hit.usage.cached_prompt_tokens == 32
        assert hit.token_ids == outs[0][1]
        assert engine.compiles_after_warmup == 0
        st.assert_idle()
    finally:
        st.close()
    return model, outs


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_engine_on_a_mesh_is_the_model_on_that_mesh(shape):
    d, e, t = shape
    model, outs = _serve_all(sharding.make_mesh({"data": d, "expert": e, "tensor": t}))
    # The mirror prefills one sequence, which a data axis cannot split (sharding refuses it): its
    # model replicates the batch on purpose, every other parameter laid out as the engine's.
    dense = ced_jax.load("tiny", mesh=model.mesh, rules={**model.rules, "batch": None})
    for prompt, ids, lps in outs:
        ref = mirror(dense, prompt, ids, slots=SLOTS, page_size=PAGE, context=CONTEXT)
        assert ids == [int(np.argmax(r)) for r in ref]
        want = [r[tok] for r, tok in zip(ref, ids, strict=True)]
        np.testing.assert_allclose(np.asarray(lps), np.asarray(want), rtol=0, atol=LOGPROB_ATOL)
