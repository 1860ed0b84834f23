"""Test setup: 8 fake CPU devices and one persistent compilation cache for the whole run.

Both must be configured before the first JAX operation, so this runs at import time. The cache is
`ced_jax.compile_cache`'s (checked entries), in `$JAX_COMPILATION_CACHE_DIR` when set (CI points the
default suite and the slow gates at one directory), else `.jax_cache/` in the repository. The variable
is exported, so every server, CLI run and multi-host worker a test starts shares it.
"""

import os
from pathlib import Path

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
REPO = Path(__file__).resolve().parent.parent
_CACHE = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or REPO / ".jax_cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_CACHE)

from ced_jax import compile_cache  # noqa: E402  (after the device count: it imports the package)

compile_cache.enable(_CACHE)
# DeepSeek's reference outputs on a tiny checkpoint (a copy of shared/golden/tiny-a).
GOLDEN_TINY_A = REPO / "tests" / "golden" / "tiny-a"

# Chat-encoding golden set (DeepSeek's reference encoder outputs). A copy lives in the repo so CI needs no
# /work/shared; `--chat-golden DIR` runs the same tests on another set in the same format (a hidden one).
GOLDEN_CHAT_ENCODING = REPO / "tests" / "golden" / "chat-encoding"

# Vision + DSpark golden fixture (a copy of shared/golden/tiny-v: a tiny checkpoint with a vision tower
# and DSpark stages, two images, DeepSeek's reference outputs). `--vision-golden DIR` runs the vision and
# DSpark parity tests on another fixture in the same format (a hidden one with other shapes, possibly
# without some optional arrays: tests compare the arrays a fixture has and say which were absent).
GOLDEN_TINY_V = REPO / "tests" / "golden" / "tiny-v"


def pytest_addoption(parser):
    parser.addoption(
        "--chat-golden",
        default=str(GOLDEN_CHAT_ENCODING),
        help="directory of a chat-encoding golden set (cases.jsonl + tokenizer.json)",
    )
    parser.addoption(
        "--vision-golden",
        default=str(GOLDEN_TINY_V),
        help="directory of a vision/DSpark golden fixture in the format of shared/golden/tiny-v",
    )
    parser.addoption(
        "--text-golden",
        default=str(GOLDEN_TINY_A),
        help="directory of a text checkpoint in the format of shared/golden/tiny-a (the CED prefill "
        "measurements run on it: a hidden fixture with other shapes works the same way)",
    )


def pytest_configure(config):
    from tests.compile_stats import CompileStatsPlugin

    config.pluginmanager.register(CompileStatsPlugin(), "ced_compile_stats")


@pytest.fixture
def fresh_programs(monkeypatch):
    """Models loaded in this test trace programs of their own instead of the process-wide ones
    (`Programs.shared`): for tests that patch a function the programs call, which only a fresh trace
    sees (and which must not leave patched programs behind for later tests)."""
    from ced_jax.engine import Programs

    monkeypatch.setattr(Programs, "shared", classmethod(lambda cls, cfg, **kw: cls(cfg, **kw)))
