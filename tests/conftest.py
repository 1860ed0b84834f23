"""Test setup: 8 fake CPU devices and JAX's persistent compilation cache.

Both must be configured before the first JAX operation, so this runs at import time.
"""

from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
_CACHE = Path(__file__).resolve().parent.parent / ".jax_cache"
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

REPO = Path(__file__).resolve().parent.parent
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
