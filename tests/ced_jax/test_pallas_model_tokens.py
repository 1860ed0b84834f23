"""The tiny preset through the Pallas kernels (interpret mode) against the reference path.

Why equality and not a tolerance: in interpret mode the kernels form the reference's products and
take its sums in its order (`pallas_kernels._tiles`, "the reference's order on XLA:CPU"), so on the
same inputs every kernel call returns the reference's output bit for bit; the second test checks
that on every call of a whole forward. The generated tokens can still differ where the paths feed
the kernels differently: the pallas path reads a query's sliding window as two segments (ring,
chunk), the reference as one in position order (`ced_jax.model.layers.attention`), so the window sums
differ in f32 order and, at a bf16 rounding tie, by one bf16 ulp, which a discrete decision can
amplify. This prompt meets none (measured: bit-identical logits at the last prompt position and
every generated step), so any other difference (a wrong group, tile, mask or sum) shows as a
different token. If a harmless change ever makes the first test fail, look for a tie before
suspecting a bug (tests/serving/test_serving_pallas.py measures how often ties move tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.api import load
from ced_jax.model.layers import kernels, moe
from ced_jax.options import Impl

PROMPT_TOKENS = 40
NEW_TOKENS = 8
PALLAS = "pallas:interpret"


def _prompt(cfg) -> list[int]:
    body = np.random.default_rng(3).integers(8, cfg.vocab_size, PROMPT_TOKENS - 1)  # no special ids
    return [cfg.bos_token_id, *body.tolist()]


@pytest.mark.slow
def test_greedy_tokens_equal_reference():
    reference = load("tiny", impl="reference")
    prompt = _prompt(reference.cfg)
    want = reference.generate(prompt, NEW_TOKENS, stop_at_eos=False)["token_ids"]
    got = load("tiny", impl=PALLAS).generate(prompt, NEW_TOKENS, stop_at_eos=False)["token_ids"]
    assert len(want) == NEW_TOKENS
    assert got == want


@pytest.mark.slow  # the tiny model compiled with every kernel call run twice: minutes on 2 cores
def test_every_kernel_call_of_the_forward_equals_the_reference(monkeypatch, fresh_programs):
    """The reference forward of the tiny model (the prompt above in chunks of 32, then 4 decode
    steps), with every sparse-attention, indexer-scoring and routed-expert call run a second time
    through the kernels on the same inputs: each kernel output equals the reference's bit for bit
    (for a Reindex layer's pool-only scores, the kernel's whole-row scores at the pool's entries).

    Before the kernels took the reference's order in interpret mode, one attention output element of
    this prompt's first chunk (layer 4) differed by one bf16 ulp: the kernel summed the softmax
    denominator as a reduce, the reference as a product with ones."""
    mismatches = []

    def record(name):
        def check(ref, got):
            ref, got = np.asarray(ref), np.asarray(got)
            same = (ref == got) | (np.isnan(ref) & np.isnan(got))
            mismatches.append((name, ref.shape, int((~same).sum())))

        return check

    sparse_attention, index_scores, expert_rows = (
        kernels.sparse_attention,
        kernels.index_scores,
        moe._expert_rows,
    )
    index_scores_at = kernels.index_scores_at

    def attention_twice(q, segments, sink, scale, *, impl):
        ref = sparse_attention(q, segments, sink, scale, impl=impl)
        jax.debug.callback(
            record("sparse_attention"),
            ref,
            sparse_attention(q, segments, sink, scale, impl=Impl.parse(PALLAS)),
        )
        return ref

    def scores_twice(q, weights, pages, table, n_visible, *, impl):
        ref = index_scores(q, weights, pages, table, n_visible, impl=impl)
        got = index_scores(q, weights, pages, table, n_visible, impl=Impl.parse(PALLAS))
        jax.debug.callback(record("index_scores"), ref, got)
        return ref

    def scores_at_twice(q, weights, pages, table, entry_ids, valid):
        # A Reindex layer scores only its candidate pool (reference path only): the kernel scores the
        # whole row, and its scores at the pool's entries must be the reference's.
        ref = index_scores_at(q, weights, pages, table, entry_ids, valid)
        width = table.shape[1] * pages.shape[1]
        whole = index_scores(
            q, weights, pages, table, jnp.full(q.shape[:2], width, jnp.int32), impl=Impl.parse(PALLAS)
        )
        at = jnp.take_along_axis(whole, jnp.clip(entry_ids, 0, width - 1), axis=-1)
        jax.debug.callback(record("index_scores"), ref, jnp.where(valid, at, -jnp.inf))
        return ref

    def expert_rows_twice(rows, eids, weights, experts, *, limit, impl, f_axis=None):
        ref = expert_rows(rows, eids, weights, experts, limit=limit, impl=impl, f_axis=f_axis)
        got = expert_rows(rows, eids, weights, experts, limit=limit, impl=Impl.parse(PALLAS), f_axis=f_axis)
        jax.debug.callback(record("expert_rows"), ref, got)
        return ref

    monkeypatch.setattr(kernels, "sparse_attention", attention_twice)
    monkeypatch.setattr(kernels, "index_scores", scores_twice)
    monkeypatch.setattr(kernels, "index_scores_at", scores_at_twice)
    monkeypatch.setattr(moe, "_expert_rows", expert_rows_twice)
    # The stored layout: the grouped-matmul kernel reads packed experts, which the reference also reads.
    model = load("tiny", impl="reference", weight_layout="stored")
    prompt = _prompt(model.cfg)
    model.logits(prompt, prompt[1:5], prefill_chunk=32)
    jax.effects_barrier()
    cfg = model.cfg
    # Per call: every layer's attention and experts, the indexer on its source layers (the whole row or
    # a Reindex layer's pool); 2 chunks + 4 steps.
    per_call = {"sparse_attention": cfg.num_layers, "expert_rows": cfg.num_layers}
    per_call["index_scores"] = len(cfg.index_source_layer_ids)
    counts = {name: sum(m[0] == name for m in mismatches) for name in per_call}
    assert counts == {name: n * 6 for name, n in per_call.items()}, counts
    assert all(m[2] == 0 for m in mismatches), [m for m in mismatches if m[2]]
