"""Four-choice questions as every benchmark reader returns them, and what the readers share:
rows of CSV and parquet files checked for their columns and answer letters, subject
selection, and errors that name what a directory holds when it is in no known layout."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pyarrow.parquet as pq

LETTERS = "ABCD"


class BenchmarkDataError(ValueError):
    """Benchmark data in none of the expected layouts, or with malformed rows."""


@dataclass(frozen=True)
class Question:
    """One four-choice question."""

    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: int
    """Index of the right choice (0-3)."""


@dataclass(frozen=True)
class BenchmarkData:
    """Questions per split and subject, in file order; subjects sorted."""

    layout: str
    """Which published layout the data was read from (e.g. "cais/mmlu", "csv")."""
    splits: dict[str, dict[str, list[Question]]]
    """{split: {subject: questions}}, e.g. {"dev": ..., "test": ...}."""


def check_columns(where: str, found: list[str], needed: Iterable[str], expected: str) -> None:
    """Raise, naming the columns found, when any of ``needed`` is missing."""
    missing = [c for c in needed if c not in found]
    if missing:
        raise BenchmarkDataError(f"{where}: columns {found} lack {missing}; expected {expected}")


def question_from_row(row: Mapping[str, Any], subject: str, columns: tuple[str, ...], where: str) -> Question:
    """A question from a row whose ``columns`` are (question, A, B, C, D, answer letter)."""
    question, *choices, answer = (row[c] for c in columns)
    letter = str(answer).strip() if answer is not None else ""
    if len(letter) != 1 or letter not in LETTERS or question is None or any(c is None for c in choices):
        raise BenchmarkDataError(
            f"{where}: expected a question, four choices and an answer letter A-D in columns {list(columns)}, "
            f"got {dict(row)!r}"
        )
    return Question(subject, str(question), tuple(str(c) for c in choices), LETTERS.index(letter))


def csv_questions(stream: TextIO, subject: str, columns: tuple[str, ...], where: str, expected: str) -> list[Question]:
    """The questions of a CSV file with a header row naming ``columns`` (question, A-D, answer)."""
    reader = csv.DictReader(stream)
    check_columns(where, list(reader.fieldnames or []), columns, expected)
    return [question_from_row(row, subject, columns, f"{where} row {n}") for n, row in enumerate(reader, start=1)]


def parquet_questions(path: Path, subject: str, columns: tuple[str, ...], expected: str) -> list[Question]:
    """The questions of a parquet file with ``columns`` (question, A-D, answer)."""
    table = pq.ParquetFile(path).read()  # read_table would import pyarrow.dataset and pandas
    check_columns(str(path), table.column_names, columns, expected)
    return [question_from_row(row, subject, columns, f"{path} row {n}") for n, row in enumerate(table.to_pylist(), 1)]


def data_dir(benchmark: str, path: str | Path, expected: str) -> Path:
    """``path`` as a directory, or an error naming the layouts expected."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise BenchmarkDataError(f"{benchmark} data {path}: not a directory; expected {expected}")
    return path


def checked(benchmark: str, path: Path, data: BenchmarkData, eval_split: str, subjects: list[str] | None,
            expected: str) -> BenchmarkData:
    """``data`` restricted to ``subjects`` (all when empty), once it holds questions to
    evaluate and every subject asked for."""
    have = data.splits.get(eval_split)
    if not have:
        raise BenchmarkDataError(f"{benchmark} data {path}: no {eval_split} questions; {describe(path)}; expected {expected}")
    if not subjects:
        return data
    unknown = sorted(set(subjects) - set(have))
    if unknown:
        raise BenchmarkDataError(f"{benchmark} data {path}: no subjects {unknown}; it has {sorted(have)}")
    keep = sorted(set(subjects))
    return BenchmarkData(data.layout, {split: {s: qs[s] for s in keep if s in qs} for split, qs in data.splits.items()})


def describe(path: Path) -> str:
    """The files under ``path`` (the first dozen), for errors about unknown layouts."""
    found = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    shown = ", ".join(found[:12]) + (f", ... ({len(found)} files)" if len(found) > 12 else "")
    return f"found [{shown}]"
