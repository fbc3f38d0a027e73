"""A pytest plugin for the suite's time: every run ends with the time spent per test module
(setup, call and teardown added up; a shared fixture's set-up counts for the module of the
first test that needs it), so the suite's growth shows where it happens, and how long before
the end each pytest-xdist process ran out of modules; and the modules run longest first, by
the seconds recorded in ``module_seconds.json``.

The two pytest-xdist processes of ``make test`` take whole modules in collection order, each
the next one when it runs out: with the longest first, no long module is left to run alone at
the end while the other process waits. ``LLMFLOW_RECORD_MODULE_SECONDS=1 make test`` writes
the run's seconds into the file (the modules it ran; the others keep theirs)."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

import pytest

RECORDED = Path(__file__).with_name("module_seconds.json")
RECORD_VARIABLE = "LLMFLOW_RECORD_MODULE_SECONDS"
LAST = ("test_real_size.py",)
"""Modules that keep both cores busy by themselves (two training ranks of a 494M-parameter
model, 14 GiB): run last, when the other process is finishing, they took 103-108 s; beside a
long module from the start of the run, 193 s."""

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)
_spans: dict[str, list[float]] = {}
"""Each pytest-xdist process's first start and last stop of a test (epoch seconds)."""


def recorded_seconds() -> dict[str, float]:
    """Each module's seconds in the last recorded run, by file name."""
    return json.loads(RECORDED.read_text())


def pytest_configure(config: pytest.Config) -> None:
    # xdist would otherwise order the modules by their number of tests, putting the long
    # one-test modules (the browser, the real-size flow) last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module not recorded yet (a new one) goes first: it may be long.
    seconds = recorded_seconds()
    items.sort(key=lambda item: (item.path.name in LAST, -seconds.get(item.path.name, math.inf)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    _tests[module].add(report.nodeid)
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is not None and report.start:
        span = _spans.setdefault(worker.id, [report.start, report.stop])
        span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    total = sum(_seconds.values())
    terminalreporter.section("time per module")
    terminalreporter.write_line(f"{'seconds':>8} {'share':>6} {'tests':>6}  module")
    for module, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} {seconds / total:6.1%} {len(_tests[module]):6d}  {module}")
    terminalreporter.write_line(f"{total:8.1f} {1:6.1%} {sum(map(len, _tests.values())):6d}  all modules")
    if len(_spans) > 1:
        # A process that ran out of modules long before the other left a core idle that long.
        first = min(start for start, _ in _spans.values())
        end = max(stop for _, stop in _spans.values())
        for worker, (start, stop) in sorted(_spans.items()):
            terminalreporter.write_line(f"{worker}: tests from {start - first:.0f} s, done {end - stop:.0f} s before "
                                        "the last process")
    if os.environ.get(RECORD_VARIABLE):
        seconds = recorded_seconds() | {Path(module).name: round(s, 1) for module, s in _seconds.items()}
        temporary = RECORDED.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(dict(sorted(seconds.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
        temporary.replace(RECORDED)
        terminalreporter.write_line(f"recorded in {RECORDED}")
