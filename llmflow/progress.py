"""How far a long stage has got, reported as it runs.

A stage calls a ``Progress`` with (items done, items in all) and, where it has one, a detail
(the generative evaluation's tokens/s): the evaluation engines once before their first batch,
then as each batch finishes. ``TerminalProgress`` shows it on stderr
(``llmflow eval``); the Prefect tasks pass one that updates a progress artifact
(``tasks/progress.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

Progress = Callable[..., None]
"""Called with (items done, items in all) and optionally a detail: ``(done, total, detail="")``."""


def no_progress(done: int, total: int, detail: str = "") -> None:
    """A ``Progress`` that shows nothing."""


def percent(done: int, total: int) -> int:
    """Whole percent of ``total`` that ``done`` is (100 for nothing to do)."""
    return 100 * done // total if total else 100


class TerminalProgress:
    """``Progress`` on ``stream`` (stderr by default): a tqdm bar when the stream is a terminal;
    else, for logs, a line "{label}: {percent}% ({done}/{total} {unit}[, {detail}])" at the start
    and each time another ``step`` percent is done. ``close`` ends the bar."""

    def __init__(self, label: str, unit: str, stream: TextIO | None = None, step: int = 10) -> None:
        self.label, self.unit, self.step = label, unit, step
        self.stream = stream or sys.stderr
        self.bar: Any = None
        self.shown = -1  # the last percent written as a line

    def __call__(self, done: int, total: int, detail: str = "") -> None:
        if self.stream.isatty():
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=self.label, unit=f" {self.unit}", file=self.stream)
            if detail:
                self.bar.set_postfix_str(detail, refresh=False)
            self.bar.update(done - self.bar.n)
            return
        mark = percent(done, total) // self.step * self.step
        if mark > self.shown:
            self.shown = mark
            extra = f", {detail}" if detail else ""
            self.stream.write(f"{self.label}: {percent(done, total)}% ({done}/{total} {self.unit}{extra})\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
