"""The documentation's runnable examples run (issue 36.6): every ```bash / ```python block that README.md
or docs/*.md marks with `<!-- runnable -->` on the line before it is executed as written, on the
embedded tiny model, in a fresh directory that sees the repository's `tests/` (the golden fixtures),
and must exit 0. Slow: each block starts JAX and compiles (about 3 minutes in all with a warm cache)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MARK = "<!-- runnable -->"
BLOCK = re.compile(r"^" + re.escape(MARK) + r"\n```(bash|python)\n(.*?)\n```$", re.M | re.S)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of every marked block."""
    out = []
    for path in DOCS:
        text = path.read_text()
        found = BLOCK.findall(text)
        assert len(found) == text.count(MARK), (
            f"{path.name}: a {MARK} mark not followed by a bash/python block"
        )
        for i, (lang, code) in enumerate(found):
            out.append((f"{path.relative_to(REPO)}#{i}", lang, code))
    return out


BLOCKS = runnable_blocks()


def test_the_readme_keeps_its_runnable_examples():
    readme = [b for b in BLOCKS if b[0].startswith("README.md")]
    assert {lang for _, lang, _ in readme} == {"bash", "python"} and len(readme) >= 3


@pytest.mark.parametrize(("where", "lang", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_a_runnable_block_runs(where, lang, code, tmp_path):
    (tmp_path / "tests").symlink_to(REPO / "tests")
    bin_dir = str(Path(sys.executable).parent)  # ced-jax and convert_weights of this environment
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
    }
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (
        f"{where} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    )
    assert run.stdout.strip(), f"{where} printed nothing"
