"""The ced-jax CLI, called in-process: describe numbers, logits files, clear errors."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ced_cli.main import main
from ced_jax.config import ASSETS
from tests.conftest import GOLDEN_TINY_A, REPO


def test_describe_v41_flash(capsys):
    assert main(["describe", "v41-flash"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["backbone"] == 551_880_835_184
    assert out["parameters"]["total"] == 763_205_315_794
    assert out["kv_bytes_per_token"] == 890
    assert out["swa_bytes_per_sequence"] == 40 * 128 * 528


def test_renamed_preset_runs_under_its_new_name(capsys, recwarn):
    assert main(["describe", "tiny-spec"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["model"] == "tiny-draft"
    assert err == "ced-jax describe: preset 'tiny-spec' is now 'tiny-draft'; the old name will be removed\n"
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]  # said once, on stderr


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


def test_serve_flags_are_the_serve_configs_declared_flags():
    """Issue 32: a serve flag is declared once, on its `ServeConfig` field or a nested config's
    (`serving.flags.flag`): the parser has each, defaults to the field's default, and a value given
    reaches the config."""
    import dataclasses

    from ced_cli.main import build_parser
    from ced_cli.serve import config_values, serve_config
    from serving.config import ServeConfig, serve_flags

    flags = serve_flags()
    assert len(flags) >= 54
    assert len({flag.name for _, _, flag in flags}) == len(flags)  # no flag twice
    parser = build_parser()
    args = parser.parse_args(["serve", "tiny"])
    for _, field, flag in flags:
        # A flag defaults to its field's default, or to the text of the command's own default, or
        # (typed otherwise than its field) to nothing given: the field's default.
        want = field.default if flag.parse is None else None
        if flag.command_default is not None:
            want = flag.command_default if flag.parse else type(field.default)(flag.command_default)
        assert getattr(args, flag.name[2:].replace("-", "_")) == want, flag.name
    given = {  # a value other than the default for one field of each kind
        "--max-queued": ("max_queued", 7),
        "--grace-period": ("grace_period_s", 2.5),
        "--kv-disk-dir": ("kv_disk_dir", None),
        "--no-overlap-schedule": ("overlap_schedule", False),
        "--shared-prefix-cache": ("share_prefix_cache", True),
    }
    argv = ["serve", "tiny", "--max-queued", "7", "--grace-period", "2.5", "--no-overlap-schedule",
            "--shared-prefix-cache"]  # fmt: skip
    args = parser.parse_args(argv)
    values = config_values(args)
    config = serve_config(args)
    for name, (field, want) in given.items():
        assert values[field] == want and getattr(config, field) == want, name
    assert {path[0] for path, _, _ in flags} <= {f.name for f in dataclasses.fields(config)}
    # A flag of a nested config (files, image fetching, HTTP limits) reaches its field there.
    config = serve_config(
        parser.parse_args(["serve", "tiny", "--files-ttl", "60", "--max-effort-queue", "3"])
    )
    assert (config.http_files.ttl_s, config.http_limits.max_tier_queue) == (60, 3)
    assert config.http_files.max_file_bytes == ServeConfig().http_files.max_file_bytes
    assert not serve_config(parser.parse_args(["serve", "tiny", "--no-prefix-cache"])).enable_prefix_cache


def test_serve_flags_typed_otherwise_than_their_fields_reach_the_config(tmp_path):
    """The flags with a parse (serving.flags.Flag): a comma list, an "off" port, one chunk length, a
    repeatable alias, a key or a key file, hosts that also turn URL fetching on; and the command's
    own defaults (the well-known ports, auto)."""
    from ced_cli.main import build_parser
    from ced_cli.serve import serve_config

    def config(*flags: str):
        return serve_config(build_parser().parse_args(["serve", "tiny", *flags]))

    default = config()
    assert (default.port, default.metrics_port, default.http_port) == (50051, 9464, 8000)
    assert default.max_tokens_limit == default.max_context > 2048  # auto, sized from the model
    assert default.prefill_buckets == (128,) and default.api_keys is None
    assert not default.http_image_fetch.allow_image_urls and default.http_models.extra_aliases == ()
    keys = tmp_path / "keys"
    keys.write_text("k1 alice\nk2 bob\n")
    c = config(
        "--max-context", "4096", "--max-tokens-limit", "512", "--prefill-chunk", "256",
        "--prefill-rows", "2,4", "--no-batch-invariant", "--decode-context-buckets", "1024",
        "--metrics-port", "-1", "--http-port", "0", "--port", "0", "--prefill-mode", "ced",
        "--model-alias", "a", "--model-alias", "b=thinking", "--allow-image-urls", "x.org, y:81",
        "--api-key-file", str(keys),
    )  # fmt: skip
    assert (c.max_context, c.max_tokens_limit, c.default_max_tokens) == (4096, 512, 256)
    assert (c.prefill_buckets, c.prefill_rows, c.decode_context_buckets) == ((256,), (2, 4), (1024, 4096))
    assert (c.port, c.metrics_port, c.http_port, c.prefill_mode) == (0, None, None, "ced")
    assert [(a.name, a.thinking) for a in c.http_models.extra_aliases] == [("a", None), ("b", True)]
    assert c.http_image_fetch.allow_image_urls and c.http_image_fetch.allowed_hosts == ("x.org", "y:81")
    assert c.api_keys.names == {"alice", "bob"}
    assert len(config("--api-key", "k3").api_keys) == 1
    assert config("--max-tokens-limit", "100").default_max_tokens == 100  # within the limit


def test_serve_bad_options_exit_2_before_loading(capsys):
    from ced_cli.main import main

    cases = [
        (
            ["--prefill-chunk", "20"],
            "prefill_buckets (--prefill-chunk) must be a multiple of page_size (--page-size) 16, got 20",
        ),
        (
            ["--max-context", "100"],
            "max_context (--max-context) must be a multiple of page_size (--page-size) 16, got 100",
        ),
        (["--max-slots", "0"], "max_slots (--max-slots) must be >= 1"),
        (
            ["--decode-context-buckets", "24"],
            "decode_context_buckets (--decode-context-buckets) must be ascending multiples of page_size "
            "(--page-size) 16",
        ),
        (
            ["--decode-context-buckets", "512,a"],
            "decode_context_buckets (--decode-context-buckets): expected comma-separated whole numbers",
        ),
        (
            ["--max-context", "2048", "--decode-context-buckets", "4096"],
            "at most max_context (--max-context) 2048, got (4096,)",
        ),
        (["--max-context", "lots"], "max_context (--max-context): expected a whole number or auto"),
        (["--api-key", "k", "--api-key-file", "/no/such"], "(--api-key / --api-key-file): give one"),
        (["--api-key", "a b c"], "api_keys (--api-key): the key: expected 'KEY' or 'KEY NAME'"),
        (["--model-alias", "x=on"], "http_models (--model-alias): model alias 'x=on'"),
        (["--allow-image-urls", "a,,b"], "allowed_hosts (--allow-image-urls): '' is not a host name"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"], "needs --mesh"),
    ]
    for extra, message in cases:
        assert main(["serve", "tiny", *extra]) == 2
        assert message in capsys.readouterr().err
    # The ports are bound before the model is loaded: free ones, so only the model can be at fault.
    assert main(["serve", "/no/such/dir", "--port", "0", "--metrics-port", "-1", "--http-port", "0"]) == 2
    assert "neither a preset" in capsys.readouterr().err


# ---------------------------------------------------------------------- numbers and paths checked first
@pytest.fixture
def nothing_loads(monkeypatch):
    """Bad options must be refused before a model is loaded or a multi-host run is joined."""

    def refuse(*args, **kwargs):
        raise AssertionError("loaded a model (or joined jax.distributed) before checking the options")

    monkeypatch.setattr("ced_jax.api.load", refuse)
    monkeypatch.setattr("jax.distributed.initialize", refuse)


def _refused(argv, capsys, *needles):
    """main(argv) exits 2 with one line on stderr that holds every needle."""
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (argv, lines[0])
    return lines[0]


HOSTS = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
# Mesh and multi-host options, shared by logits, generate and serve: (extra argv, needles).
MESH_AND_HOST_CASES = [
    (["--mesh", "expert=2,expert=4"], ("--mesh", "expert", "twice")),
    (["--mesh", "pipeline=2"], ("--mesh", "pipeline")),
    (["--mesh", "expert=0"], ("--mesh", "expert", ">= 1")),
    (["--mesh", "tensor=-2"], ("--mesh", "tensor", "-2")),
    (["--mesh", "tensor=two"], ("--mesh", "tensor", "two")),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "0", "--process-id", "0"], ("--num-processes", "0")),
    ([*HOSTS, "--init-timeout", "0"], ("--init-timeout", ">= 1")),
    (["--init-timeout", "-5"], ("--init-timeout", "-5")),
]
GENERATE_CASES = [
    (["--temperature", "nan"], ("--temperature", "nan")),
    (["--temperature", "inf"], ("--temperature", "inf")),
    (["--temperature", "-0.5"], ("--temperature", "-0.5")),
    (["--seed", "-1"], ("--seed", "-1")),
    (["--seed", str(2**32)], ("--seed", str(2**32))),
    (["--max-tokens", "0"], ("--max-tokens", ">= 1")),
    (["--max-tokens", "-3"], ("--max-tokens", "-3")),
]


@pytest.mark.parametrize(("extra", "needles"), GENERATE_CASES + MESH_AND_HOST_CASES)
def test_generate_bad_numbers_exit_2_before_loading(extra, needles, capsys, nothing_loads):
    _refused(["generate", "tiny", "--prompt", "hi", *extra], capsys, *needles)


def test_generate_max_tokens_beyond_the_context_exits_2(capsys, nothing_loads):
    for model, directory in (("tiny", ASSETS / "tiny"), (str(GOLDEN_TINY_A), GOLDEN_TINY_A)):
        text_config = json.loads((directory / "config.json").read_text())["text_config"]
        context = text_config["max_position_embeddings"]
        argv = ["generate", model, "--prompt", "hi", "--max-tokens", str(context + 1)]
        _refused(argv, capsys, "--max-tokens", str(context + 1), f"context of {context} tokens")


@pytest.fixture
def ids_file(tmp_path):
    path = tmp_path / "prompt.json"
    path.write_text("[0, 5, 6]")
    return path


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--prefill-chunk", "0"], ("--prefill-chunk", ">= 1")),
        (["--prefill-chunk", "-4"], ("--prefill-chunk", "-4")),
        *MESH_AND_HOST_CASES,
    ],
)
def test_logits_bad_numbers_exit_2_before_loading(extra, needles, ids_file, tmp_path, capsys, nothing_loads):
    out = tmp_path / "o.safetensors"
    _refused(["logits", "tiny", "--prompt-ids", str(ids_file), "--out", str(out), *extra], capsys, *needles)
    assert not out.exists()


def test_logits_unwritable_outputs_exit_2_before_computing(ids_file, tmp_path, capsys, nothing_loads):
    ok = tmp_path / "o.safetensors"
    base = ["logits", "tiny", "--prompt-ids", str(ids_file)]
    missing = tmp_path / "missing" / "o.safetensors"
    # /sys (sysfs) takes no new files, as a read-only filesystem would not.
    for flag in ("--out", "--capture"):
        other = [] if flag == "--out" else ["--out", str(ok)]
        _refused([*base, *other, flag, str(tmp_path)], capsys, flag, "is a directory")
        _refused([*base, *other, flag, str(missing)], capsys, flag, "does not exist")
        _refused([*base, *other, flag, "/sys/o.safetensors"], capsys, flag, "cannot create files in /sys")
    assert not missing.parent.exists()  # not created either
    _refused([*base, "--out", str(ok), "--capture", str(ok)], capsys, "--capture", "--out")
    assert list(tmp_path.iterdir()) == [ids_file]  # no probe file left behind


def test_unreadable_ids_file_exits_2(tmp_path, capsys, nothing_loads):
    out = str(tmp_path / "o.safetensors")
    _refused(["logits", "tiny", "--prompt-ids", str(tmp_path), "--out", out], capsys, "--prompt-ids")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    _refused(["logits", "tiny", "--prompt-ids", str(binary), "--out", out], capsys, "--prompt-ids")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--page-size", "0"], ("--page-size", ">= 1")),
        (["--max-slots", "-1"], ("--max-slots", "-1")),
        (["--max-context", "0"], ("--max-context", ">= 1")),
        (["--num-pages", "0"], ("--num-pages", ">= 1")),
        (["--prefill-chunk", "0"], ("--prefill-chunk", ">= 1")),
        (["--max-running", "0"], ("--max-running", ">= 1")),
        (["--max-queued", "-1"], ("--max-queued", ">= 0")),
        (["--max-tokens-limit", "0"], ("--max-tokens-limit", ">= 1")),
        (["--grace-period", "-1"], ("--grace-period", "-1")),
        (["--grace-period", "nan"], ("--grace-period", "nan")),
        *MESH_AND_HOST_CASES,
    ],
)
def test_serve_bad_numbers_exit_2_before_loading(extra, needles, capsys, nothing_loads):
    _refused(
        ["serve", "tiny", "--port", "0", "--metrics-port", "-1", "--http-port", "0", *extra], capsys, *needles
    )


def test_console_script_bad_number_is_one_line_without_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "ced_cli.main", "generate", "tiny", "--prompt", "hi", "--temperature", "nan"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "ced-jax generate: error: --temperature must be a finite number >= 0, got nan"
    ]


# ---------------------------------------------------------------------- serve: ports first
@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--port", "99999"], ("port (--port) must be in 0..65535", "99999")),
        (["--port", "-1"], ("port (--port) must be in 0..65535", "-1")),
        (["--metrics-port", "65536"], ("metrics_port (--metrics-port) must be in 0..65535", "65536")),
        (["--metrics-port", "-2"], ("metrics_port (--metrics-port) must be in 0..65535", "None (off)", "-2")),
        (["--http-port", "-2"], ("http_port (--http-port) must be in 0..65535", "-2")),
        (["--http-port", "70000"], ("http_port (--http-port) must be in 0..65535", "70000")),
        (["--max-prompt-bytes", "0"], ("--max-prompt-bytes", ">= 1")),
        (["--max-tokenize-bytes", "0"], ("--max-tokenize-bytes", ">= 1")),
    ],
)
def test_serve_bad_ports_and_text_limits_exit_2(extra, needles, capsys, nothing_loads):
    _refused(["serve", "tiny", *extra], capsys, *needles)


def _serve_subprocess(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "ced_cli.main", "serve", "tiny", "--http-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    return run, time.monotonic() - start


def test_serve_on_a_busy_grpc_port_exits_2_before_loading():
    # The holder is a gRPC server with gRPC's default options (SO_REUSEPORT on), as `ced-jax serve`
    # used to listen; a second server that also set it would start and share the port.
    holder = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        run, elapsed = _serve_subprocess("--port", str(port), "--metrics-port", "-1")
    finally:
        holder.stop(None)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"ced-jax serve: error: --port: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert run.stdout == ""  # nothing started, nothing loaded
    assert elapsed < 30, elapsed  # seconds (Python start-up on a busy machine), not a load and compile


def test_serve_on_a_busy_metrics_port_exits_2_before_loading():
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        run, elapsed = _serve_subprocess("--port", "0", "--metrics-port", str(port))
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"ced-jax serve: error: --metrics-port: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert run.stdout == ""
    assert elapsed < 30, elapsed


def test_every_option_states_its_default(capsys):
    """Each --help (every subcommand, `ced-jax client`, `convert_weights`) names every option's
    default (or says it is required)."""
    import argparse

    from ced_cli.main import build_parser, convert_main
    from serving.client import build_parser as client_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices, client=client_parser())
    for name, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = formatter._get_help_string(action).lower()
            assert "default" in text or "(required)" in text, (name, action.option_strings, text)
    assert "(default: auto)" in " ".join(sub.choices["serve"].format_help().split())
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        convert_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out.split("options:")[1]
    for chunk in text.split("\n  --")[1:]:  # one per option after -h
        assert "default" in chunk.lower() or "(required)" in chunk, chunk
