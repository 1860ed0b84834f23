"""The ced-jax CLI, called in-process: describe numbers, logits files, clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from ced_cli.main import main
from tests.conftest import GOLDEN_TINY_A


def test_describe_v41_flash(capsys):
    assert main(["describe", "v41-flash"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["backbone"] == 551_880_835_184
    assert out["parameters"]["total"] == 763_205_315_794
    assert out["kv_bytes_per_token"] == 890
    assert out["swa_bytes_per_sequence"] == 40 * 128 * 528


def test_logits_capture_then_replay(tmp_path):
    g = load_file(str(GOLDEN_TINY_A / "expected.safetensors"))
    (tmp_path / "prompt.json").write_text(json.dumps(g["prompt_ids"][:40].tolist()))
    (tmp_path / "decode.json").write_text(json.dumps(g["decode_ids"][:3].tolist()))
    args = [
        "logits",
        str(GOLDEN_TINY_A),
        "--prompt-ids",
        str(tmp_path / "prompt.json"),
        "--decode-ids",
        str(tmp_path / "decode.json"),
    ]
    assert (
        main(
            args + ["--out", str(tmp_path / "a.safetensors"), "--capture", str(tmp_path / "cap.safetensors")]
        )
        == 0
    )
    a = load_file(str(tmp_path / "a.safetensors"))
    assert a["prefill_logits_full"].shape == (40, 512) and a["decode_logits"].shape == (3, 512)
    cap = load_file(str(tmp_path / "cap.safetensors"))
    assert cap["prefill_gate_indices"].shape == (8, 40, 2) and cap["decode_topk_layer6"].shape == (3, 16)
    # Replaying our own decisions reproduces our own logits.
    assert (
        main(args + ["--out", str(tmp_path / "b.safetensors"), "--replay", str(tmp_path / "cap.safetensors")])
        == 0
    )
    b = load_file(str(tmp_path / "b.safetensors"))
    np.testing.assert_array_equal(a["prefill_logits_full"], b["prefill_logits_full"])
    np.testing.assert_array_equal(a["decode_logits"], b["decode_logits"])


def test_logits_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys):
    (tmp_path / "prompt.json").write_text(json.dumps([0, 99999]))
    out = tmp_path / "o.safetensors"
    assert (
        main(["logits", str(GOLDEN_TINY_A), "--prompt-ids", str(tmp_path / "prompt.json"), "--out", str(out)])
        == 2
    )
    assert "99999" in capsys.readouterr().err and not out.exists()
    (tmp_path / "prompt.json").write_text("[0, 1.5]")
    assert (
        main(["logits", str(GOLDEN_TINY_A), "--prompt-ids", str(tmp_path / "prompt.json"), "--out", str(out)])
        == 2
    )
    save_file({"prefill_topk_layer2": np.zeros((5, 3), np.int32)}, str(tmp_path / "bad.safetensors"))
    (tmp_path / "prompt.json").write_text("[0, 5, 6]")
    capsys.readouterr()
    assert (
        main(
            [
                "logits",
                str(GOLDEN_TINY_A),
                "--prompt-ids",
                str(tmp_path / "prompt.json"),
                "--replay",
                str(tmp_path / "bad.safetensors"),
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "prefill_topk_layer2" in capsys.readouterr().err and not out.exists()


def test_missing_tensor_is_named(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_TINY_A, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.3.attn.wkv.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "prompt.json").write_text("[0, 5]")
    code = main(
        ["logits", str(ckpt), "--prompt-ids", str(tmp_path / "prompt.json"), "--out", str(tmp_path / "o")]
    )
    assert code == 2
    assert "layers.3.attn.wkv.weight" in capsys.readouterr().err


def test_generate_tiny(capsys):
    assert main(["generate", "tiny", "--prompt", "hello", "--max-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= len(out["token_ids"]) <= 4


def test_serve_bad_options_exit_2_before_loading(capsys):
    from ced_cli.main import main

    cases = [
        (["--prefill-chunk", "20"], "prefill bucket 20 must be a multiple of page_size 16"),
        (["--max-context", "100"], "max_context 100 must be a multiple of page_size 16"),
        (["--max-slots", "0"], "max_slots must be >= 1"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"], "multi-host"),
    ]
    for extra, message in cases:
        assert main(["serve", "tiny", *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["serve", "/no/such/dir"]) == 2
    assert "neither a preset" in capsys.readouterr().err
