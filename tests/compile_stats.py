"""A pytest plugin: XLA compile time and counts per test module, from JAX's own monitoring events.

Every executable JAX builds fires `/jax/core/compile/backend_compile_duration` on the compiling thread;
one loaded from the persistent cache fires `/jax/compilation_cache/cache_hits` just before it. Each
test's totals (setup, call and teardown together) travel on its report, so under xdist the controller
sums them per module and prints the top modules at the end. Programs compiled in a subprocess (a
server or CLI run a test starts) are not seen here: the module's wall time in the table includes them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict

import jax.monitoring
import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_KEY = "ced_compile_stats"
TOP = 15


class _Totals:
    __slots__ = ("fresh", "fresh_s", "loaded", "loaded_s", "trace_s", "lower_s")

    def __init__(self):
        self.fresh = self.loaded = 0
        self.fresh_s = self.loaded_s = self.trace_s = self.lower_s = 0.0

    def as_tuple(self):
        return (self.fresh, self.fresh_s, self.loaded, self.loaded_s, self.trace_s, self.lower_s)

    def add(self, values):
        self.fresh += values[0]
        self.fresh_s += values[1]
        self.loaded += values[2]
        self.loaded_s += values[3]
        self.trace_s += values[4]
        self.lower_s += values[5]


_lock = threading.Lock()
_current = _Totals()
_hit_pending = threading.local()
_current_module = ["(collection)"]
# CED_COMPILE_LOG=FILE: every compile's program, shapes and seconds, a line each with its test module
# (appended by every worker), to find the programs that several modules build.
_LOG = os.environ.get("CED_COMPILE_LOG")


def _on_event(event: str, **kwargs):
    if event == _HIT_EVENT:
        _hit_pending.value = True


def _on_duration(event: str, duration: float, **kwargs):
    with _lock:
        if event == _COMPILE_EVENT:
            hit = getattr(_hit_pending, "value", False)
            if hit:
                _hit_pending.value = False
                _current.loaded += 1
                _current.loaded_s += duration
            else:
                _current.fresh += 1
                _current.fresh_s += duration
            if _LOG:
                source = "cache" if hit else "fresh"
                _write_log(f"{_current_module[0]}\t{source}\t{duration:.2f}\t{kwargs.get('fun_name')}")
        elif event == _TRACE_EVENT:
            _current.trace_s += duration
        elif event == _LOWER_EVENT:
            _current.lower_s += duration


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _write_log(line: str) -> None:
    with open(_LOG, "a") as f:
        f.write(line + "\n")


class _ShapesHandler(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            _write_log(f"{_current_module[0]}\tshapes\t{message!r}")


if _LOG:
    jax.config.update("jax_log_compiles", True)
    for name in ("jax._src.interpreters.pxla", "jax._src.dispatch", "jax._src.pjit"):
        logging.getLogger(name).addHandler(_ShapesHandler())


def _take() -> tuple:
    global _current
    with _lock:
        taken, _current = _current, _Totals()
    return taken.as_tuple()


class CompileStatsPlugin:
    def __init__(self):
        self.by_module: dict[str, _Totals] = defaultdict(_Totals)
        self.wall: dict[str, float] = defaultdict(float)

    # Compiles between tests (a module fixture's teardown runs in the last test's teardown) go to the
    # test being reported.
    def pytest_runtest_logstart(self, nodeid, location):
        _current_module[0] = nodeid.split("::", 1)[0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when == "teardown":
            report.user_properties.append((_KEY, _take()))

    def pytest_runtest_logreport(self, report):
        module = report.nodeid.split("::", 1)[0]
        self.wall[module] += getattr(report, "duration", 0.0)
        for key, value in report.user_properties:
            if key == _KEY:
                self.by_module[module].add(value)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.by_module:
            return
        rows = sorted(
            self.by_module.items(), key=lambda kv: kv[1].fresh_s + kv[1].loaded_s, reverse=True
        )
        total = _Totals()
        for _, t in rows:
            total.add(t.as_tuple())
        tr = terminalreporter
        tr.write_sep("=", f"XLA compiles by test module (top {TOP} by compile seconds)")
        tr.write_line(
            f"{'module':<58} {'wall s':>7} {'compile s':>9} {'fresh':>6} {'cached':>6} "
            f"{'load s':>6} {'trace s':>7} {'lower s':>7}"
        )
        for module, t in rows[:TOP]:
            tr.write_line(
                f"{module[-58:]:<58} {self.wall[module]:7.1f} {t.fresh_s:9.1f} {t.fresh:6d} "
                f"{t.loaded:6d} {t.loaded_s:6.1f} {t.trace_s:7.1f} {t.lower_s:7.1f}"
            )
        tr.write_line(
            f"{'all ' + str(len(rows)) + ' modules':<58} {sum(self.wall.values()):7.1f} "
            f"{total.fresh_s:9.1f} {total.fresh:6d} {total.loaded:6d} {total.loaded_s:6.1f} "
            f"{total.trace_s:7.1f} {total.lower_s:7.1f}"
        )
        tr.write_line(
            "compile s: fresh XLA compiles; cached / load s: executables loaded from the persistent "
            "cache; wall s: the module's test durations summed over workers (subprocess compiles included)"
        )
