"""The rows of a comparison: what the tables, the merge and the advisor pass around."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmflow.probe.compare.reading import ERROR, PASS, Leaf


@dataclass
class Row:
    """One line of the comparison."""

    leaf: Leaf
    cells: dict[str, Any]
    result: str = PASS
    messages: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """Metric values used by the result rules."""
    stack: list[str] = field(default_factory=list)
    """The call stack of the row's call."""
    stat_errors: dict[str, float] = field(default_factory=dict)
    """Relative errors of the Max, Min, Mean and Norm statistics (any mode but md5), where
    msprobe gives one in percent."""

    def flag(self, result: str, message: str) -> None:
        if result == ERROR or self.result == PASS:
            self.result = result
        self.messages.append(message)


@dataclass
class RankComparison:
    rank: str
    mode: str
    """tensor, statistics or md5."""
    rows: list[Row]
    csv: str
    """File name of this rank's table in the output folder."""
    origins: dict[str, list[list]] | None = None
    """For a target put together from pipeline stages: merged entry -> [rank folder, entry
    there, stage] of each part."""
