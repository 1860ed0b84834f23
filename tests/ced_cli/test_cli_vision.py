"""`ced-jax logits --request inputs.json`: a vision fixture's request (prompt text and image files)
as the prompt, and its refusals (exit 2, one line naming the field, nothing loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ced_cli.main import main


@pytest.fixture(scope="module")
def fixture_dir(request) -> Path:
    return Path(request.config.getoption("vision_golden"))


def _kl_mean(ref: np.ndarray, ours: np.ndarray) -> float:
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(ours)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def test_logits_from_a_fixture_request(fixture_dir, tmp_path, capsys):
    """The request's prompt_text and image files run through pre-processing, the ViT and the text
    model; with the recorded decisions replayed the prefill logits are the fixture's within the
    end-to-end bars of tests/ced_jax/test_parity_vision.py (the same computation)."""
    inputs = json.loads((fixture_dir / "inputs.json").read_text())
    if "prompt_text" not in inputs or "image_files" not in inputs:
        pytest.skip("the fixture's inputs.json has no prompt_text / image_files")
    g = load_file(str(fixture_dir / "expected.safetensors"))
    cfg = json.loads((fixture_dir / "config.json").read_text())
    index_layers = cfg["text_config"]["index_source_layer_ids"]
    replay = {"prefill_gate_indices": g["prefill_gate_indices"]}
    replay.update({f"prefill_topk_layer{i}": g[f"prefill_topk_layer{i}"] for i in index_layers})
    save_file(replay, str(tmp_path / "replay.safetensors"))
    (tmp_path / "no_decode.json").write_text("[]")
    out = tmp_path / "out.safetensors"
    argv = ["logits", str(fixture_dir), "--request", str(fixture_dir / "inputs.json"), "--out", str(out)]
    argv += [
        "--decode-ids",
        str(tmp_path / "no_decode.json"),
        "--replay",
        str(tmp_path / "replay.safetensors"),
    ]
    capsys.readouterr()
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["images"] == len(inputs["image_files"])
    assert summary["prefill_tokens"] == len(inputs["prompt_ids"])
    res = load_file(str(out))
    ours = res["prefill_logits_full"]
    assert ours.shape == (len(inputs["prompt_ids"]), cfg["text_config"]["vocab_size"])
    assert res["decode_logits"].shape == (0, ours.shape[1])
    ref = g.get("prefill_logits_full")
    if ref is None:  # only the last row recorded
        ours, ref = ours[-1:], g["prefill_logits_last"][None]
    assert np.abs(ours - ref).mean() <= 0.5
    assert _kl_mean(ref, ours) <= 0.25


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded a model before checking the request")

    monkeypatch.setattr("ced_jax.api.load", refuse)


def _refused(argv, capsys, *needles):
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (argv, err)


def test_bad_requests_exit_2_before_loading(fixture_dir, tmp_path, capsys, nothing_loads):
    out = str(tmp_path / "o.safetensors")
    base = ["logits", str(fixture_dir), "--out", out]
    ids = tmp_path / "ids.json"
    ids.write_text("[0, 5]")
    _refused([*base], capsys, "--prompt-ids", "--request")
    _refused([*base, "--prompt-ids", str(ids), "--request", str(ids)], capsys, "--prompt-ids", "--request")
    _refused([*base, "--request", str(tmp_path / "missing.json")], capsys, "--request", "does not exist")
    _refused([*base, "--request", str(ids)], capsys, "--request", "JSON object")
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt_text": "hi <｜deepseek_image｜>", "image_files": ["gone.png"]}))
    _refused([*base, "--request", str(request)], capsys, "image_files[0]", "does not exist")
    (tmp_path / "a.png").write_bytes(b"only its existence is checked before loading")
    request.write_text(json.dumps({"prompt_ids": [0, 7, 7], "image_files": ["a.png"]}))
    _refused([*base, "--request", str(request)], capsys, "token_types")
    request.write_text(json.dumps({"prompt_ids": [0, 7], "token_types": [-1]}))
    _refused([*base, "--request", str(request)], capsys, "token_types", "prompt_ids")
    request.write_text(json.dumps({"prompt_text": 5}))
    _refused([*base, "--request", str(request)], capsys, "prompt_text")
    assert not Path(out).exists()


def test_generate_image_refusals(fixture_dir, tmp_path, capsys):
    """A missing --image file is refused before loading; an image for a model without a vision tower
    (the tiny preset) is refused by name, before anything runs."""
    prompt = ["--prompt", "look: <｜deepseek_image｜>"]
    _refused(
        ["generate", str(fixture_dir), *prompt, "--image", str(tmp_path / "gone.png")], capsys, "--image"
    )
    image = tmp_path / "a.png"
    image.write_bytes(b"never decoded")
    _refused(["generate", "tiny", *prompt, "--image", str(image)], capsys, "no vision tower")
