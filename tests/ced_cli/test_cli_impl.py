"""`--impl reference|pallas` and `--interpret` on `ced-jax logits` / `generate`: the impl string
they combine into, the refused combinations, and a logits run through the Pallas kernels.

The end-to-end run uses the one-layer cut of the tiny preset (interpret-mode compiles of the full
8-layer model take minutes; tests/ced_jax/test_parity_pallas.py covers that depth, marked slow):
`ced_jax.api.load` is replaced by a loader that records the impl the CLI hands it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import ced_jax.api
import pallas_kernels.grouped_matmul as gmm_module
from ced_cli.main import build_parser, main
from tests.ced_jax.test_parity_pallas import _one_layer_tiny

LOGITS = ["logits", "tiny", "--prompt-ids", "p.json", "--out", "o.safetensors"]
GENERATE = ["generate", "tiny", "--prompt", "hi"]


@pytest.mark.parametrize("base", [LOGITS, GENERATE], ids=["logits", "generate"])
@pytest.mark.parametrize(
    "flags,impl",
    [
        ([], "reference"),
        (["--impl", "reference"], "reference"),
        (["--impl", "pallas"], "pallas"),
        (["--impl", "pallas", "--interpret"], "pallas:interpret"),
        (["--interpret", "--impl", "pallas"], "pallas:interpret"),
        (["--interpret"], "pallas:interpret"),
    ],
)
def test_impl_flags_combine(base, flags, impl):
    assert build_parser().parse_args(base + flags).impl == impl


@pytest.mark.parametrize("base", [LOGITS, GENERATE], ids=["logits", "generate"])
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--impl", "reference", "--interpret"], "needs --impl pallas"),
        (["--interpret", "--impl", "reference"], "needs --impl pallas"),
        (["--impl", "xla"], "invalid choice"),
        (["--impl", "pallas:gpu"], "invalid choice"),
    ],
)
def test_impl_flags_refused(base, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(base + flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_logits_impl_pallas_interpret_runs_the_kernels(tmp_path, monkeypatch, fresh_programs):
    cfg, flat = _one_layer_tiny()
    seen, gmm_calls = [], []

    def fake_load(path, *, impl, mesh=None, **kw):
        assert path == "tiny" and mesh is None
        seen.append(impl)
        return ced_jax.api.Model(cfg, flat, hasher=None, tokenizer_path=None, impl=impl)

    real_gmm = gmm_module.gmm

    def spy_gmm(*a, **kw):
        gmm_calls.append(kw.get("interpret"))
        return real_gmm(*a, **kw)

    monkeypatch.setattr(ced_jax.api, "load", fake_load)
    monkeypatch.setattr(gmm_module, "gmm", spy_gmm)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 12).tolist()
    (tmp_path / "p.json").write_text(json.dumps(prompt))
    base = ["logits", "tiny", "--prompt-ids", str(tmp_path / "p.json")]
    assert main(base + ["--out", str(tmp_path / "ref.safetensors")]) == 0
    assert gmm_calls == []
    assert main(base + ["--out", str(tmp_path / "pal.safetensors"), "--impl", "pallas", "--interpret"]) == 0
    assert seen == ["reference", "pallas:interpret"]
    assert gmm_calls == [True] * 3  # w1, w3, w2 of the layer's routed experts, interpreted
    ref = load_file(str(tmp_path / "ref.safetensors"))["prefill_logits_full"]
    got = load_file(str(tmp_path / "pal.safetensors"))["prefill_logits_full"]
    assert ref.shape == (12, cfg.vocab_size)
    # Same tolerance as test_parity_pallas: kernels differ from the reference in f32 sum order only.
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
