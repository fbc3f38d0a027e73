"""A pytest plugin that ends every run with the time spent per test module (setup, call and
teardown added up; a shared fixture's set-up counts for the module of the first test that
needs it), so the suite's growth shows where it happens."""

from __future__ import annotations

from collections import defaultdict

import pytest

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    _tests[module].add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    total = sum(_seconds.values())
    terminalreporter.section("time per module")
    terminalreporter.write_line(f"{'seconds':>8} {'share':>6} {'tests':>6}  module")
    for module, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} {seconds / total:6.1%} {len(_tests[module]):6d}  {module}")
    terminalreporter.write_line(f"{total:8.1f} {1:6.1%} {sum(map(len, _tests.values())):6d}  all modules")
