"""The vision and DSpark parity tests on the second fixture, tests/golden/tiny-v2 (issue 37: other
shapes than tiny-v's: a 96-wide 3-block tower, three images with odd patch counts and the plain-resize
path, 3 DSpark stages of block 5). The default suite runs them on tiny-v; this slow gate runs the same
modules with `--vision-golden tests/golden/tiny-v2` in a pytest of their own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = (
    "tests/ced_jax/test_dspark.py",
    "tests/ced_jax/test_vision_preprocess.py",
    "tests/ced_jax/test_parity_vision.py",
    "tests/ced_jax/test_vision_tower.py",
    "tests/ced_jax/test_dspark_load.py",
)


@pytest.mark.slow
def test_parity_modules_pass_on_tiny_v2():
    fixture = REPO / "tests" / "golden" / "tiny-v2"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n0", "-m", "slow or not slow"]
    run = subprocess.run(
        [*argv, "--vision-golden", str(fixture), *MODULES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = [line for line in run.stdout.splitlines() if re.search(r"\b\d+ passed\b", line)]
    assert summary and "skipped" not in summary[-1], run.stdout[-3000:]
