"""MMLU questions from either layout it is published in.

- ``cais/mmlu`` (Hugging Face): parquet files with columns question, subject, choices (four
  strings), answer (0-3), either one folder per subject (``{subject}/{split}-*.parquet``),
  an ``all/`` folder, or ``{split}-*.parquet`` files at the top (the subject then comes from
  the subject column);
- the original CSVs: ``data/{dev,test}/{subject}_{split}.csv``, headerless rows
  question,A,B,C,D,answer letter.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pyarrow.parquet as pq

from llmflow.evaluate.questions import (
    LETTERS,
    BenchmarkData,
    BenchmarkDataError,
    Question,
    check_columns,
    checked,
    data_dir,
    describe,
)

SPLITS = ("dev", "test")
PARQUET_COLUMNS = ("question", "choices", "answer")
_SKIPPED_FOLDERS = ("auxiliary_train",)
EXPECTED_LAYOUTS = (
    "the cais/mmlu layout ({subject}/{dev,test}-*.parquet, all/{dev,test}-*.parquet or "
    "{dev,test}-*.parquet with columns question, subject, choices, answer) or the original CSV "
    "layout (data/{dev,test}/{subject}_{split}.csv, headerless rows question,A,B,C,D,answer letter)"
)


def _csv_root(path: Path) -> Path | None:
    for root in (path / "data", path):
        if all(any((root / split).glob(f"*_{split}.csv")) for split in SPLITS):
            return root
    return None


def _read_csv(path: Path, subject: str) -> list[Question]:
    questions = []
    with open(path, newline="", encoding="utf-8") as f:
        for row_number, row in enumerate(csv.reader(f), start=1):
            if len(row) != 6 or row[5].strip() not in tuple(LETTERS):
                raise BenchmarkDataError(
                    f"{path} row {row_number}: expected 6 fields question,A,B,C,D,answer letter (A-D), got {row!r}"
                )
            questions.append(Question(subject, row[0], tuple(row[1:5]), LETTERS.index(row[5].strip())))
    return questions


def _load_csv(root: Path) -> BenchmarkData:
    splits: dict[str, dict[str, list[Question]]] = {split: {} for split in SPLITS}
    for split in SPLITS:
        for f in sorted((root / split).glob(f"*_{split}.csv")):
            subject = f.name[: -len(f"_{split}.csv")]
            splits[split][subject] = _read_csv(f, subject)
    return BenchmarkData("csv", splits)


def _split_of(path: Path) -> str | None:
    for split in SPLITS:
        if path.name == f"{split}.parquet" or path.name.startswith(f"{split}-"):
            return split
    return None


def _parquet_files(path: Path) -> list[Path]:
    files = [p for p in sorted(path.rglob("*.parquet")) if not set(p.relative_to(path).parts) & set(_SKIPPED_FOLDERS)]
    combined = [p for p in files if p.parent == path / "all"]
    return combined or files


def _read_parquet(path: Path) -> list[Question]:
    table = pq.ParquetFile(path).read()  # read_table would import pyarrow.dataset and pandas
    check_columns(str(path), table.column_names, PARQUET_COLUMNS, EXPECTED_LAYOUTS)
    rows = table.to_pylist()
    folder_subject = path.parent.name
    questions = []
    for row_number, row in enumerate(rows):
        choices, answer = row["choices"], row["answer"]
        if choices is None or len(choices) != 4 or answer not in range(4):
            raise BenchmarkDataError(f"{path} row {row_number}: expected four choices and answer 0-3, got {row!r}")
        subject = row.get("subject") or folder_subject
        questions.append(Question(subject, row["question"], tuple(choices), int(answer)))
    return questions


def _load_parquet(files: list[Path]) -> BenchmarkData:
    splits: dict[str, dict[str, list[Question]]] = {split: {} for split in SPLITS}
    for path in files:
        split = _split_of(path)
        if split is None:
            continue
        for q in _read_parquet(path):
            splits[split].setdefault(q.subject, []).append(q)
    return BenchmarkData("cais/mmlu", {split: dict(sorted(subjects.items())) for split, subjects in splits.items()})


def load_mmlu(path: str | Path, subjects: list[str] | None = None) -> BenchmarkData:
    """The dev and test questions under ``path`` (either layout, detected), restricted to
    ``subjects`` when given."""
    path = data_dir("MMLU", path, EXPECTED_LAYOUTS)
    csv_root = _csv_root(path)
    if csv_root is not None:
        data = _load_csv(csv_root)
    else:
        files = [p for p in _parquet_files(path) if _split_of(p) is not None]
        if not files:
            raise BenchmarkDataError(f"MMLU data {path}: {describe(path)}; expected {EXPECTED_LAYOUTS}")
        data = _load_parquet(files)
    return checked("MMLU", path, data, "test", subjects, EXPECTED_LAYOUTS)
