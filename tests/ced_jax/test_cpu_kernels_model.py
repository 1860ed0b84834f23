"""The model with impl="cpu" (the CPU kernels of `pallas_kernels._cpu`: the FP4 experts, the FP8
linears and the indexer's scores) gives the XLA path's values bit for bit: each kernel against the
model's own XLA-path function at the shapes the model calls it with (decode rows, prefill tiles, one
row), and the whole model on tiny-a (mode A's replayed run: every captured array; a free greedy run:
logits at every step and the tokens). Spies check that every kernel ran in the prefill and the decode
programs; PARITY.md's mode-A gate holds with its bars unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ced_jax.api import load
from ced_jax.model.layers import common, kernels, moe
from ced_jax.options import REFERENCE, Impl
from pallas_kernels.fp8_linear import kernel_cpu as fp8_kernel
from pallas_kernels.grouped_matmul import kernel_cpu
from pallas_kernels.indexer import kernel_cpu as index_kernel
from tests.ced_jax.test_parity import assert_mode_a_gate, mode_a_metrics, mode_a_run
from tests.conftest import GOLDEN_TINY_A
from tests.pallas_kernels.cases import fp8_activations

CPU = Impl("cpu")


def _spy(monkeypatch, module, name) -> list:
    """The shapes of the first argument `module.name` is traced with."""
    calls, real = [], getattr(module, name)

    def spy(first, *args, **kw):
        calls.append(first.shape)
        return real(first, *args, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


def _experts(rng, e, n, k):
    packed = rng.integers(0, 256, (e, n, k // 2)).astype(np.uint8)
    scales = rng.integers(127 - 10, 127 + 4, (e, n, k // 32)).astype(np.uint8)
    return {"weight": jnp.asarray(packed), "scale": jnp.asarray(scales)}


# Rows of a decode step (one row per entry, up to a group of 8 and past it) and of prefill tiles.
@pytest.mark.parametrize("m, k, n, e", [(1, 1024, 512, 16), (6, 512, 1024, 16), (13, 2048, 128, 32)])
def test_the_fp4_kernel_gives_the_xla_paths_expert_products(m, k, n, e):
    rng = np.random.default_rng(m + k)
    rows = jnp.asarray(fp8_activations(rng, (m, k)))
    ids = jnp.asarray(rng.integers(0, e, m).astype(np.int32))
    w = _experts(rng, e, n, k)
    xla = jax.jit(lambda r, i, w: kernels.expert_matmul(r, i, w, impl=REFERENCE))(rows, ids, w)
    cpu = jax.jit(lambda r, i, w: kernels.expert_matmul(r, i, w, impl=CPU))(rows, ids, w)
    assert np.array_equal(np.asarray(xla), np.asarray(cpu))


def test_the_fp4_kernel_gives_the_xla_paths_prefill_experts():
    """Many rows: the XLA path runs each expert's rows in tiles (`moe._expert_rows_by_expert`)."""
    rng = np.random.default_rng(7)
    m, d, f, e = 96, 768, 256, 8
    rows = jnp.asarray(fp8_activations(rng, (m, d)))
    ids = jnp.asarray(rng.integers(0, e, m).astype(np.int32))
    weights = jnp.asarray(rng.random(m).astype(np.float32))
    experts = {"w1": _experts(rng, e, f, d), "w3": _experts(rng, e, f, d), "w2": _experts(rng, e, d, f)}

    def run(impl):
        fn = lambda r, i, wt, ex: moe._expert_rows(r, i, wt, ex, limit=7.0, impl=impl)  # noqa: E731
        return np.asarray(jax.jit(fn)(rows, ids, weights, experts))

    assert np.array_equal(run(REFERENCE), run(CPU))


@pytest.mark.parametrize("m, k, n", [(1, 1024, 2048), (2, 768, 5120), (40, 2048, 128), (300, 256, 1024)])
def test_the_fp8_kernel_gives_the_xla_paths_linear(m, k, n):
    rng = np.random.default_rng(m + n)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    weight = jnp.asarray((rng.standard_normal((n, k)) * 8).astype(jnp.float8_e4m3fn))
    scale = jnp.asarray(rng.integers(127 - 12, 127 + 4, (n // 32, k // 32)).astype(np.uint8))
    p = {"weight": weight, "scale": scale}
    xla = jax.jit(lambda x, p: common.fp8_linear(x, p, impl=REFERENCE))(x, p)
    cpu = jax.jit(lambda x, p: common.fp8_linear(x, p, impl=CPU))(x, p)
    assert np.array_equal(np.asarray(xla), np.asarray(cpu))


@pytest.fixture(scope="module")
def golden():
    return load_file(str(GOLDEN_TINY_A / "expected.safetensors"))


def test_tiny_a_with_the_cpu_kernels_is_the_xla_path_bit_for_bit(monkeypatch, golden, fresh_programs):
    calls = _spy(monkeypatch, kernel_cpu, "expert_rows")
    linear_calls = _spy(monkeypatch, fp8_kernel, "linear_rows")
    index_calls = _spy(monkeypatch, index_kernel, "index_scores")
    model = load(str(GOLDEN_TINY_A), impl="cpu")
    assert model.weight_layout != "f32"  # the kernel reads the packed experts
    res = mode_a_run(model, golden, "intended")
    xla = mode_a_run(load(str(GOLDEN_TINY_A), impl="reference"), golden, "intended")
    assert set(res) == set(xla)
    differ = [
        key for key in res if not np.array_equal(np.asarray(res[key]), np.asarray(xla[key]), equal_nan=True)
    ]
    assert not differ, differ
    assert_mode_a_gate(mode_a_metrics(model, golden, "intended", res))
    assert len(set(calls)) >= 2, calls  # traced with the prompt's rows and with a decode step's
    assert len(set(linear_calls)) >= 2, linear_calls
    assert len(set(index_calls)) >= 2, index_calls


@pytest.mark.slow  # four programs of their own (about 70 s of compiles on the 2-core machine)
def test_free_greedy_decoding_on_tiny_a_is_the_xla_paths(golden):
    """Not replayed: the model's own decisions, two rows, a prompt and eight greedy steps."""
    prompts = np.asarray(golden["prompt_ids"]).reshape(1, -1)[:, :24].repeat(2, 0) % 400 + 3
    prompts[1] = prompts[1][::-1]

    def run(impl):
        session = load(str(GOLDEN_TINY_A), impl=impl).new_session(2, 40)
        logits, _ = session.step(prompts.astype(np.int32))
        out = [np.asarray(logits)]
        for _ in range(8):
            last = out[-1][:, -1] if out[-1].ndim == 3 else out[-1]
            logits, _ = session.step(last.argmax(-1).astype(np.int32)[:, None])
            out.append(np.asarray(logits))
        return out

    xla, cpu = run("reference"), run("cpu")
    assert all(np.array_equal(a, b) for a, b in zip(xla, cpu, strict=True))


def test_the_f32_expert_layout_is_refused_with_the_cpu_kernel():
    with pytest.raises(ValueError, match=r"weight_layout='f32': impl='cpu' runs the FP4 expert kernel"):
        load(str(GOLDEN_TINY_A), impl="cpu", weight_layout="f32")
