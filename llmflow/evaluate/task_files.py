"""Reading a task's files, whatever the task: the rows of parquet and JSON-lines files, each
with where it came from (file and row, for errors), a parquet file's columns checked before
its rows are read, the files of a split found by glob patterns, and a split's documents."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.parquet as pq

from llmflow.evaluate.questions import BenchmarkDataError, check_columns, describe

D = TypeVar("D")


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of a parquet or JSON-lines file."""
    if path.suffix == ".parquet":
        # ParquetFile.read: read_table would import pyarrow.dataset and pandas (a second of start-up)
        for n, row in enumerate(pq.ParquetFile(path).read().to_pylist(), 1):
            yield f"{path} row {n}", row
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path} line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise BenchmarkDataError(f"{path} line {n}: not JSON ({e.msg})") from None


def excerpt(row: dict[str, Any]) -> str:
    """The start of ``row`` as JSON, for errors about it (values JSON lacks written as text)."""
    return json.dumps(row, ensure_ascii=False, default=str)[:300]


def check_parquet_columns(path: Path, needed: tuple[str, ...], expected: str) -> None:
    """Raise, naming the columns found, when a parquet file lacks any of ``needed``."""
    if path.suffix == ".parquet":
        check_columns(str(path), pq.read_schema(path).names, needed, expected)


def split_files(root: Path, split: str, patterns: tuple[str, ...]) -> list[Path]:
    """The files under ``root`` matching any of ``patterns`` (globs with ``{split}``), sorted."""
    return sorted({p for pattern in patterns for p in root.glob(pattern.format(split=split)) if p.is_file()})


def read_split(title: str, root: Path, split: str, layouts: tuple[tuple[str, ...], ...], columns: tuple[str, ...],
               expected: str, make_doc: Callable[[dict[str, Any], str], D]) -> list[D]:
    """The documents of ``split`` under ``root``: the files of the first of ``layouts`` (each a
    tuple of globs with ``{split}``) that has any, each row made a document by ``make_doc(row,
    where)``; an error naming what ``root`` holds and the ``expected`` layouts when none has."""
    files = next((found for patterns in layouts if (found := split_files(root, split, patterns))), [])
    if not files:
        shown = describe(root) if root.is_dir() else "no such directory"
        raise BenchmarkDataError(f"{title} data {root}: no {split} split; {shown}; expected {expected}")
    for path in files:
        check_parquet_columns(path, columns, expected)
    return [make_doc(row, where) for path in files for where, row in read_rows(path)]
