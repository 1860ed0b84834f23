"""bench/device_check.py end to end on CPU in its --smoke mode (interpret mode, tiny shapes): every
GPU kernel variant is checked against its reference and timed, one table comes out; and a kernel
that is off by 0.1 % is reported as a failure with exit status 1."""

from __future__ import annotations

import importlib.util
import json
import sys

import jax.numpy as jnp

from tests.conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("device_check", REPO / "bench" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module while the file runs
    spec.loader.exec_module(module)
    return module


def test_smoke_runs_every_gpu_kernel(tmp_path, capsys):
    dc = _module()
    rows, status = dc.run(["--smoke", "--json", str(tmp_path / "rows.json")])
    assert status == 0, [r.error for r in rows if not r.ok]
    kernels = [r.kernel for r in rows]
    variants = ("gmm w1 decode", "gmm w2 prefill", "attention decode", "attention prefill", "indexer", "mhc")
    for variant in (*variants, "vision"):
        assert any(k.startswith(variant) for k in kernels), (variant, kernels)
    assert all(r.time_s > 0 and r.bytes > 0 and r.flops > 0 for r in rows)
    table = capsys.readouterr().out
    device, header, *lines = table.strip().splitlines()
    assert "smoke" in device and "roofline us" in header and len(lines) == len(rows)
    assert all(line.startswith(r.kernel) and " ok " in line for line, r in zip(lines, rows, strict=True))
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert [r["kernel"] for r in saved] == kernels and all(r["roofline_s"] > 0 for r in saved)


def test_smoke_reports_a_wrong_kernel(monkeypatch, capsys):
    dc = _module()
    real = dc.gmm
    monkeypatch.setattr(dc, "gmm", lambda *a, **kw: real(*a, **kw) * jnp.float32(1.001))
    rows, status = dc.run(["--smoke", "--only", "gmm"])
    assert status == 1 and rows and not any(r.ok for r in rows)
    assert "FAIL" in capsys.readouterr().out
