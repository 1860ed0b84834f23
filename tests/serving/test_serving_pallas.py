"""`ced-jax serve tiny --impl pallas --interpret` serves over gRPC the same greedy tokens as
`ced-jax serve tiny --impl reference` (issue 10, acceptance 2), at every step where greedy decoding
is well defined against the measured difference between the two servers' log-probs.

Both servers run as the command a user starts, with the same small shapes (2 slots, pages of 16
tokens, 128 tokens of context, prefill chunks of 32): the pallas one runs the paged sparse-attention,
indexer and grouped-matmul kernels in the HLO interpreter, reading the KV pages through the page
tables. Two requests run concurrently on each, with prompts of more than one prefill chunk. Slow:
compiling the interpret-mode programs takes minutes on 2 cores.

What agrees and what does not. In interpret mode the kernels form the reference's products and sums
in the reference's order (`pallas_kernels._tiles`, "the reference's order on XLA:CPU"), so on the same
inputs their outputs equal the reference path's bit for bit (tests/ced_jax/test_parity_pallas.py).
The forward still differs in one place: the pallas path hands the kernels a query's sliding window
as two segments, the slot's ring and the chunk, where they are
(`ced_jax.model.layers.attention.window_segments`), the reference as one segment in position order
(`window_segment_by_position`), so the window's softmax sums are taken in another f32 order. Where
such a sum sits on a bf16 rounding tie an attention output moves by one bf16 ulp, and a discrete
decision downstream (a top-k entry, an expert) can make that a visible log-prob difference.
Measured with these servers over the 48 requests of prompt seeds 0-23 (16 greedy steps each, steps
with equal history; |log-prob difference| over the ids in both top-20 lists): 0 at 714 of 750 steps,
otherwise 0.0017 to 1.63 nats, and 3 requests' greedy tokens parted at reference gaps of 0.09-0.17.
With the pallas path also given the by-position window (measured by patching
`window_segments`), the difference was 0 at all 768 steps and every token equal.

So greedy equality is asserted where it is well defined: a token can only move where the
reference's top-1/top-2 gap is below twice the log-prob difference at that step.
- The test measures that difference at every compared step (with equal history) from both servers'
  top-20 log-probs, and requires each compared step's reference gap (from the reference's own
  log-probs over gRPC) to be at least max(MIN_GAP, GAP_FACTOR x the largest difference measured on
  the request). It FAILS otherwise, naming the steps: the kernels' error grew.
- The prompt is chosen from the reference's gaps alone, never from the pallas server's tokens: the
  first seed from PROMPT_SEED whose two requests both have a gap of at least MIN_GAP at each compared
  step, found with the reference server when the test runs. A fixed seed did not hold: the gaps move
  with the reference's numerics (seeds 3, 28, 42 and 46 each went below MIN_GAP after a numerics
  change) and with the machine's XLA:CPU kernels (seed 46, chosen at stop 42 with a smallest gap of
  0.104, has a gap of 0.0344 at the 33-token request's step 3 on an AVX-512 AMD EPYC at stop 45,
  commits 8392ea0 to now, the two servers equal there bit for bit). The seed used is printed.
- Then the tokens must be equal at every compared step; on a mismatch the message gives the first
  differing step and both servers' top-5 log-probs there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from serving import client
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

SHAPES = ["--max-slots", "2", "--page-size", "16", "--max-context", "128", "--prefill-chunk", "32"]
PROMPT_LENGTHS = (40, 33)  # two prefill chunks each: a full one, then a partial one
PROMPT_SEED = 46  # where the scan for a well-defined prompt starts (module docstring)
SEED_TRIES = 100  # about 0.5 s each (the reference server, 10 tokens a request)
COMPARED = 10  # greedy steps per request, all compared
TOP = 20  # log-probs per step: the most a request may ask (ServeConfig.max_logprobs)
MIN_GAP = 0.1  # nats: a floor, so that no compared step is a near-tie
GAP_FACTOR = 4.0  # gap >= 4 x the measured error: a flip needs gap < 2 x error
IMPL_ARGS = {"reference": ["--impl", "reference"], "pallas": ["--impl", "pallas", "--interpret"]}


def _start(impl_args: list[str], log_path):
    """A `ced-jax serve tiny` subprocess on a free port; returns (process, log file)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "8",  # as tests/conftest.py, so the persistent cache entries match
        "JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [sys.executable, "-m", "ced_cli.main", "serve", "tiny", *SHAPES, *impl_args]
    cmd += ["--port", "0", "--metrics-port", "-1", "--http-port", "0", "--max-tokens-limit", str(COMPARED)]
    log = open(log_path, "w+")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log


def _address(proc, log_path, deadline: float) -> str:
    while time.monotonic() < deadline:
        m = re.search(r"serving \S+ on (\S+)", log_path.read_text())
        if m:
            return m.group(1)
        assert proc.poll() is None, f"server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        time.sleep(1.0)
    raise AssertionError(f"no server address in time:\n{log_path.read_text()[-3000:]}")


def _greedy_pair(addr: str, prompts: list[list[int]]) -> list[client.Completion]:
    """The prompts sent at once (both in the decode batch together)."""

    def one(prompt):
        return client.generate(addr, prompt, max_tokens=COMPARED, temperature=0.0, logprobs=TOP,
                               ignore_eos=True, timeout=1200)  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _top(out: client.Completion, step: int, n: int = TOP) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in out.logprobs[step].top[:n]]


def _gap(out: client.Completion, step: int) -> float:
    """The reference's top-1 minus top-2 log-prob at `step` (its greedy margin)."""
    (_, first), (_, second) = _top(out, step, 2)
    return first - second


def _error(ref: client.Completion, got: client.Completion, step: int) -> float:
    """The largest |log-prob difference| at `step` over the ids in both servers' top lists."""
    a, b = dict(_top(ref, step)), dict(_top(got, step))
    shared = a.keys() & b.keys()
    assert shared, f"step {step}: the servers' top-{TOP} lists share no token"
    return max(abs(a[i] - b[i]) for i in shared)


def _first_difference(ref: client.Completion, got: client.Completion) -> int:
    diff = np.asarray(ref.token_ids) != np.asarray(got.token_ids)
    return int(np.argmax(diff)) if diff.any() else len(ref.token_ids)


def _prompts(seed: int) -> list[list[int]]:
    body = np.random.default_rng(seed).integers(8, 512, PROMPT_LENGTHS[0] - 1).tolist()
    return [[0, *body][:n] for n in PROMPT_LENGTHS]  # BOS, no eos/pad


def _well_defined_seed(addr: str) -> tuple[int, list[client.Completion]]:
    """The first seed from PROMPT_SEED whose two requests have a reference gap of at least MIN_GAP at
    every compared step, and the reference's completions of it: chosen on this machine, from the
    reference server alone (its gaps move with XLA:CPU's kernels, hence with the CPU)."""
    gaps_seen = {}
    for seed in range(PROMPT_SEED, PROMPT_SEED + SEED_TRIES):
        outs = _greedy_pair(addr, _prompts(seed))
        gaps = [min(_gap(out, step) for step in range(COMPARED)) for out in outs]
        if min(gaps) >= MIN_GAP:
            return seed, outs
        gaps_seen[seed] = round(min(gaps), 4)
    raise AssertionError(f"no seed in {SEED_TRIES} tries has every reference gap >= {MIN_GAP}: {gaps_seen}")


def test_serve_pallas_interpret_greedy_tokens_equal_reference(tmp_path):
    servers = {}
    try:
        for name, impl_args in IMPL_ARGS.items():  # both compile at once
            servers[name] = (*_start(impl_args, tmp_path / f"{name}.log"), tmp_path / f"{name}.log")
        deadline = time.monotonic() + 1800
        results, seconds = {}, {}
        for name, (proc, _, log_path) in servers.items():
            addr = _address(proc, log_path, deadline)
            start = time.monotonic()
            if name == "reference":
                seed, results[name] = _well_defined_seed(addr)
                prompts = _prompts(seed)
                print(f"prompt seed {seed}")
            else:
                results[name] = _greedy_pair(addr, prompts)
            seconds[name] = time.monotonic() - start
        print("generation seconds", seconds)
        for name, (proc, _, _) in servers.items():
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, name
    finally:
        for proc, log, _ in servers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()

    failures = []
    for i, (ref, got) in enumerate(zip(results["reference"], results["pallas"], strict=True)):
        for out in (ref, got):
            assert out.finish_reason == "length" and len(out.token_ids) == COMPARED
            assert out.usage.prompt_tokens == PROMPT_LENGTHS[i] and len(out.logprobs) == COMPARED
        for step in range(COMPARED):  # the greedy token is the top-1 (the lists are sorted)
            assert ref.token_ids[step] == _top(ref, step, 1)[0][0], (i, step)
        gaps = [_gap(ref, step) for step in range(COMPARED)]
        # The history is the same up to the first differing token, so the error is measured there.
        first = _first_difference(ref, got)
        errors = [_error(ref, got, step) for step in range(min(first + 1, COMPARED))]
        bound = max(MIN_GAP, GAP_FACTOR * max(errors))
        print(f"request {i}: reference gaps {np.round(gaps, 4).tolist()}")
        print(f"request {i}: |log-prob difference| per step {np.round(errors, 5).tolist()}")
        short = [(step, round(g, 4)) for step, g in enumerate(gaps) if g < bound]
        if short:
            failures.append(
                f"request {i} (prompt of {PROMPT_LENGTHS[i]}, seed {seed}): greedy decoding is not "
                f"well defined at these compared steps: (step, reference top-1/top-2 gap) {short} are "
                f"below max(MIN_GAP={MIN_GAP}, {GAP_FACTOR} x the largest measured log-prob difference "
                f"{max(errors):.5f}): the difference grew, the kernels no longer agree with the reference."
            )
        if first < COMPARED:
            failures.append(
                f"request {i} (prompt of {PROMPT_LENGTHS[i]}): greedy tokens differ from step {first} "
                f"(reference gap there {gaps[first]:.4f})\n"
                f"reference {list(ref.token_ids)}\npallas    {list(got.token_ids)}\n"
                f"top-5 (id, log-prob) at step {first}: reference {_top(ref, first, 5)}\n"
                f"                                 pallas    {_top(got, first, 5)}"
            )
    assert not failures, "\n\n".join(failures)
