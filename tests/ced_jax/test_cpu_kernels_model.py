"""The model with impl="cpu" (the CPU kernels of `pallas_kernels._cpu`: the FP4 experts, the FP8
linears and the indexer's scores).

The kernels sum in their own order (exact 32-value blocks, then the blocks in order), not the XLA
path's, so the model is held to PARITY.md's mode A on tiny-a, bars unchanged, rather than to the
reference path's bits; spies check that both kernels ran in the prefill and the decode programs."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file

from ced_jax.api import load
from pallas_kernels.fp8_linear import kernel_cpu as fp8_kernel
from pallas_kernels.grouped_matmul import kernel_cpu
from pallas_kernels.indexer import kernel_cpu as index_kernel
from tests.ced_jax.test_parity import assert_mode_a_gate, mode_a_metrics
from tests.conftest import GOLDEN_TINY_A


def _spy(monkeypatch, module, name) -> list:
    """The shapes of the first argument `module.name` is traced with."""
    calls, real = [], getattr(module, name)

    def spy(first, *args, **kw):
        calls.append(first.shape)
        return real(first, *args, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_mode_a_on_tiny_a_with_the_cpu_kernels(monkeypatch, fresh_programs):
    calls = _spy(monkeypatch, kernel_cpu, "expert_rows")
    linear_calls = _spy(monkeypatch, fp8_kernel, "linear_rows")
    index_calls = _spy(monkeypatch, index_kernel, "index_scores")
    golden = load_file(str(GOLDEN_TINY_A / "expected.safetensors"))
    model = load(str(GOLDEN_TINY_A), impl="cpu")
    assert model.weight_layout != "f32"  # the kernel reads the packed experts
    m = mode_a_metrics(model, golden, "intended")
    assert_mode_a_gate(m)
    assert len(set(calls)) >= 2, calls  # traced with the prompt's rows and with a decode step's
    assert len(set(linear_calls)) >= 2, linear_calls
    assert len(set(index_calls)) >= 2, index_calls


def test_the_f32_expert_layout_is_refused_with_the_cpu_kernel():
    with pytest.raises(ValueError, match=r"weight_layout='f32': impl='cpu' runs the FP4 expert kernel"):
        load(str(GOLDEN_TINY_A), impl="cpu", weight_layout="f32")
