"""bench/RESULTS.md: each benchmark's rows of the Current table and its History entries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmflow.artifacts import atomic_file

RESULTS = Path(__file__).with_name("RESULTS.md")


def first_cell(row: str) -> str:
    """A table row's first cell with its delimiters, e.g. "| `bench.generate` batch 1 |"."""
    return row.split(" | ", 1)[0] + " |"


def update_results(current: list[str], entry: list[str], stale: Callable[[str], bool] = lambda row: False) -> None:
    """Put ``current`` into the Current table in place of the rows with the same first cell (and
    of every row ``stale`` says is superseded), and append ``entry`` to History; atomically."""
    head, sep, history = RESULTS.read_text().partition("\n## History\n")
    replaced = {first_cell(row) for row in current}
    lines, at = [], None
    for line in head.split("\n"):
        if line.startswith("| `bench.") and (first_cell(line) in replaced or stale(line)):
            at = len(lines) if at is None else at
        else:
            lines.append(line)
    if at is None:  # a new benchmark goes after the last row
        at = max(i for i, line in enumerate(lines) if line.startswith(("| `bench.", "|---"))) + 1
    lines[at:at] = current
    with atomic_file(RESULTS, "w") as f:
        f.write("\n".join(lines) + sep + history.rstrip("\n") + "\n\n" + "\n".join(entry).strip("\n") + "\n")
    print(f"recorded in {RESULTS}", flush=True)
