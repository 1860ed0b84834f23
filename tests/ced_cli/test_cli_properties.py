"""Property tests over `ced-jax` flag values (hypothesis, fixed seed): a bad value ends in exit status 2
with exactly one line on stderr that names the flag, never a traceback, and it is refused before
anything slow happens. Only values that are wrong on their own are generated, so the model loader
(`ced_jax.api.load`) and the server (`serving.server.serve`) are replaced by stand-ins that fail the
test if they are reached: a value that gets that far was not validated up front.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ced_cli.main import convert_main, main
from ced_jax.config import PRESETS
from tests.conftest import GOLDEN_TINY_A

pytestmark = pytest.mark.timeout(300)

PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
    # One failing example per test, shrunk: shrinking several distinct failures at once took minutes.
    report_multiple_bugs=False,
)


class ReachedSlowPath(AssertionError):
    """A bad value got past validation to the model load or the server start."""


def _refuse(what: str):
    def stand_in(*args, **kwargs):
        raise ReachedSlowPath(f"{what} was reached: the bad value was not refused up front")

    return stand_in


def run_cli(argv: list[str], entry=main) -> tuple[int, str]:
    """(exit status, stderr) of the CLI, with the slow paths replaced by stand-ins that fail."""
    err, out = io.StringIO(), io.StringIO()
    with (
        mock.patch("ced_jax.api.load", _refuse("the model load")),
        mock.patch("serving.server.serve", _refuse("the server start")),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(out),
    ):
        try:
            rc = entry(argv)
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
    return rc, err.getvalue()


def error_lines(err: str) -> list[str]:
    # Terminal lines: split on "\n" only (str.splitlines would also split on \r, \x1c, ...).
    return [line for line in err.split("\n") if line.strip()]


def assert_refused(argv: list[str], flag: str, entry=main) -> None:
    rc, err = run_cli(argv, entry)
    lines = error_lines(err)
    assert "Traceback" not in err, err
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1, (argv, lines)
    assert flag in lines[0], (argv, flag, lines[0])


# ------------------------------------------------------------------------------ value strategies
def non_positive_ints():
    return st.one_of(st.integers(max_value=0), st.sampled_from([0, -1, -(2**31), -(2**63)]))


def negative_ints():
    return st.one_of(st.integers(max_value=-1), st.sampled_from([-1, -(2**63)]))


def non_finite():
    return st.sampled_from([math.nan, math.inf, -math.inf])


def negative_floats():
    return st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=True)


def flag(name: str, value) -> str:
    # `--flag=value`, so that a negative value is never read as an option.
    return f"{name}={value!r}" if isinstance(value, float) else f"{name}={value}"


# ------------------------------------------------------------------------------ describe
@PROPERTY
@given(model=st.text(max_size=40))
def test_describe_any_model_name(model):
    rc, err = run_cli(["describe", model])
    assert "Traceback" not in err, err
    if model in PRESETS:
        assert rc == 0, err
    else:
        lines = error_lines(err)
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("ced-jax describe: error:"), (model, err)


# ------------------------------------------------------------------------------ generate
GENERATE_BAD = st.one_of(
    st.tuples(st.just("--max-tokens"), non_positive_ints()),
    st.tuples(st.just("--temperature"), st.one_of(non_finite(), negative_floats())),
    st.tuples(st.just("--seed"), st.one_of(negative_ints(), st.integers(min_value=2**32))),
)


@PROPERTY
@given(bad=GENERATE_BAD)
def test_generate_bad_numbers(bad):
    name, value = bad
    assert_refused(["generate", "tiny", "--prompt", "hello", flag(name, value)], name)


def test_generate_empty_prompt():
    assert_refused(["generate", "tiny", "--prompt="], "--prompt")


# ------------------------------------------------------------------------------ logits
def bad_id_files():
    """File contents that are not a JSON list of token ids."""
    not_json = st.text(max_size=30).filter(lambda s: not _is_json(s))
    not_a_list = st.one_of(
        st.integers(), st.text(max_size=10), st.dictionaries(st.text(max_size=3), st.integers())
    )
    bad_items = st.lists(
        st.one_of(st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
                  st.text(max_size=3), st.booleans(), st.none()),
        min_size=1, max_size=5,
    )  # fmt: skip
    mixed = st.tuples(st.lists(st.integers(0, 100), max_size=4), bad_items).map(lambda t: t[0] + t[1])
    return st.one_of(
        not_json,
        not_a_list.map(json.dumps),
        mixed.map(json.dumps),
        st.just("[]"),  # no prompt at all (for --decode-ids: no decode steps, which is fine)
    )


def _is_json(s: str) -> bool:
    try:
        data = json.loads(s)
    except ValueError:
        return False
    return isinstance(data, list) and len(data) > 0 and all(type(v) is int for v in data)


@PROPERTY
@given(content=bad_id_files(), which=st.sampled_from(["--prompt-ids", "--decode-ids"]))
def test_logits_bad_id_files(content, which):
    assume(not (which == "--decode-ids" and content == "[]"))
    with tempfile.TemporaryDirectory() as d:
        good, bad, out = Path(d) / "good.json", Path(d) / "bad.json", Path(d) / "out.safetensors"
        good.write_text("[0, 5, 6]")
        bad.write_text(content)
        files = {"--prompt-ids": good, "--decode-ids": good, which: bad}
        argv = ["logits", str(GOLDEN_TINY_A), "--out", str(out)]
        argv += [f"--prompt-ids={files['--prompt-ids']}", f"--decode-ids={files['--decode-ids']}"]
        assert_refused(argv, which)
        assert not out.exists()


@PROPERTY
@given(chunk=non_positive_ints())
def test_logits_bad_prefill_chunk(chunk):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "p.json").write_text("[0, 5, 6]")
        argv = ["logits", str(GOLDEN_TINY_A), "--prompt-ids", str(Path(d) / "p.json"), "--out", f"{d}/o.st"]
        assert_refused([*argv, flag("--prefill-chunk", chunk)], "--prefill-chunk")


# ------------------------------------------------------------------------------ serve
def not_multiple_of_page(limit: int):
    return st.integers(1, limit).filter(lambda n: n % 16)  # the default --page-size is 16


# Defaults: --max-slots 32 --page-size 16 --max-context auto --prefill-chunk 128 (--num-pages below 32
# leave less than a page for each of the 32 sequences that auto sizes the context for).
SERVE_BAD = st.one_of(
    st.tuples(st.just("--max-slots"), non_positive_ints()),
    st.tuples(st.just("--page-size"), non_positive_ints()),
    st.tuples(st.just("--max-context"), st.one_of(non_positive_ints(), not_multiple_of_page(10**6))),
    st.tuples(st.just("--num-pages"), st.one_of(negative_ints(), st.integers(1, 31))),
    st.tuples(st.just("--prefill-chunk"), st.one_of(non_positive_ints(), not_multiple_of_page(4096))),
    st.tuples(st.just("--max-running"), st.one_of(non_positive_ints(), st.integers(min_value=33))),
    st.tuples(st.just("--max-queued"), negative_ints()),
    st.tuples(st.just("--max-tokens-limit"), non_positive_ints()),
    st.tuples(st.just("--max-prompt-bytes"), negative_ints()),
    st.tuples(st.just("--max-tokenize-bytes"), negative_ints()),
    st.tuples(st.just("--port"), st.one_of(negative_ints(), st.integers(min_value=65536))),
    st.tuples(st.just("--metrics-port"), st.one_of(st.integers(max_value=-2), st.integers(min_value=65536))),
    st.tuples(st.just("--grace-period"), st.one_of(negative_floats(), st.just(math.nan))),
)  # fmt: skip


@PROPERTY
@given(bad=SERVE_BAD)
def test_serve_bad_numbers(bad):
    name, value = bad
    assert_refused(["serve", "tiny", flag(name, value)], name)


# ------------------------------------------------------------------------------ plan
PLAN_BAD = st.one_of(
    st.tuples(st.just("--devices"), non_positive_ints()),
    st.tuples(st.just("--device-memory"), st.one_of(non_finite(), negative_floats(), st.just(0.0))),
    st.tuples(st.just("--host-memory"), st.one_of(st.just(math.nan), negative_floats())),
    st.tuples(st.just("--max-seqs"), non_positive_ints()),
    st.tuples(st.just("--context"), non_positive_ints()),
    st.tuples(st.just("--prefill-bucket"), non_positive_ints()),
    st.tuples(st.just("--mesh"), st.sampled_from(["data", "data=", "data=x", "foo=2", "data=0", "data=-1",
                                                   "expert=2,expert=2", ",", "data=1;tensor=2"])),
)  # fmt: skip


@PROPERTY
@given(bad=PLAN_BAD)
def test_plan_bad_values(bad):
    name, value = bad
    base = {"--devices": 8, "--device-memory": 80.0}
    argv = ["plan", "--model", "tiny"] + [flag(k, v) for k, v in base.items() if k != name]
    assert_refused([*argv, flag(name, value)], name)


def test_plan_good_values_exit_0_or_1():
    rc, err = run_cli(["plan", "--model", "tiny", "--devices", "8", "--device-memory", "80"])
    assert rc in (0, 1) and "Traceback" not in err, err


# ------------------------------------------------------------------------------ convert
def _copy_checkpoint(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in GOLDEN_TINY_A.iterdir():
        if p.name != "expected.safetensors":  # outputs of the reference, not part of a checkpoint
            shutil.copyfile(p, dst / p.name)
    return dst


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@settings(PROPERTY, max_examples=15)
@given(
    target=st.sampled_from(["file", "non_empty_dir", "hf_dir", "inside_hf_dir", "parent_of_hf_dir"]),
    overwrite=st.booleans(),
    # tiny-a has no vision tower and no DSpark stages, so only "text" is a valid --include.
    include=st.sampled_from(["text", "text,audio", "audio", "text,vision", "dspark"]),
)
def test_convert_never_destroys_what_it_refuses(target, overwrite, include):
    """Every --out below is something a conversion must not replace; each is refused with one line
    naming the flag, and every file under the scratch root is still there, byte for byte."""
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        hf = _copy_checkpoint(root / "work" / "hf")
        (root / "work" / "notes.txt").write_text("precious")
        out = {
            "file": root / "work" / "notes.txt",
            "non_empty_dir": root / "work",
            "hf_dir": hf,
            "inside_hf_dir": hf / "converted",
            "parent_of_hf_dir": root / "work",
        }[target]
        if target == "non_empty_dir":
            out = root / "work" / "mine"
            out.mkdir()
            (out / "keep.txt").write_text("keep me")
        before = _tree(root)
        argv = ["--hf-dir", str(hf), f"--out={out}", f"--include={include}", "--quiet"]
        argv += ["--overwrite"] if overwrite else []
        bad_flags = ("--out", "--include") if include != "text" else ("--out",)
        rc, err = run_cli(argv, entry=convert_main)
        lines = error_lines(err)
        assert "Traceback" not in err and rc == 2 and len(lines) == 1, (argv, rc, err)
        assert any(f in lines[0] for f in bad_flags), (argv, lines[0])
        assert _tree(root) == before, "a refused conversion changed files"
