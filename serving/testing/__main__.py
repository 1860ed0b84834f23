"""`python -m serving.testing [--grace S] [--step-delay S] [--port P]`: the server over the mock engine
(tests of the server's lifecycle, demos), with a byte tokenizer and tiny shapes."""

from __future__ import annotations

import argparse
import logging
import sys

from serving.config import ServeConfig
from serving.server import serve
from serving.testing.mock_engine import ByteTokenizer, MockEngine


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.testing", description=__doc__)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    engine = MockEngine(
        max_slots=4,
        page_size=4,
        num_pages=64,
        max_context=64,
        prefill_buckets=(4, 8, 16),
        step_delay_s=a.step_delay,
    )
    config = ServeConfig(
        max_slots=4, page_size=4, num_pages=64, max_context=64, prefill_buckets=(4, 8, 16),
        max_logprobs=5, max_tokens_limit=60, default_max_tokens=16, grace_period_s=a.grace, port=a.port,
    )  # fmt: skip
    return serve(config, lambda: (engine, ByteTokenizer()))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
