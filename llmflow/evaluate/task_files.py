"""Reading a task's files, whatever the task: the rows of parquet and JSON-lines files, each
with where it came from (file and row, for errors), a parquet file's columns checked before
its rows are read, and the files of a split found by glob patterns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from llmflow.evaluate.questions import BenchmarkDataError, check_columns


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of a parquet or JSON-lines file."""
    if path.suffix == ".parquet":
        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {n}", row
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path} line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise BenchmarkDataError(f"{path} line {n}: not JSON ({e.msg})") from None


def check_parquet_columns(path: Path, needed: tuple[str, ...], expected: str) -> None:
    """Raise, naming the columns found, when a parquet file lacks any of ``needed``."""
    if path.suffix == ".parquet":
        check_columns(str(path), pq.read_schema(path).names, needed, expected)


def split_files(root: Path, split: str, patterns: tuple[str, ...]) -> list[Path]:
    """The files under ``root`` matching any of ``patterns`` (globs with ``{split}``), sorted."""
    return sorted({p for pattern in patterns for p in root.glob(pattern.format(split=split)) if p.is_file()})
