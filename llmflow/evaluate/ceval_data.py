"""C-Eval questions from either layout it is published in.

- ``ceval/ceval-exam`` (Hugging Face): one folder per subject with ``{dev,val,test}-*.parquet``;
- ``ceval-exam.zip`` unpacked: ``{dev,val,test}/{subject}_{split}.csv`` with a header row.

Both have columns id, question, A, B, C, D, answer (a letter) and explanation. Only dev (the
few-shot examples) and val are read: the test split's answers are not published.
"""

from __future__ import annotations

from pathlib import Path

from llmflow.evaluate.questions import (
    BenchmarkData,
    Question,
    checked,
    csv_questions,
    data_dir,
    parquet_questions,
)

SPLITS = ("dev", "val")
COLUMNS = ("question", "A", "B", "C", "D", "answer")
EXPECTED_LAYOUTS = (
    "the ceval/ceval-exam layout ({subject}/{dev,val}-*.parquet) or the unpacked ceval-exam.zip "
    "({dev,val}/{subject}_{split}.csv), with columns id, question, A, B, C, D, answer"
)


def _subject_files(path: Path, split: str, parquet: bool) -> dict[str, list[Path]]:
    if not parquet:
        return {f.name[: -len(f"_{split}.csv")]: [f] for f in sorted(path.glob(f"{split}/*_{split}.csv"))}
    files: dict[str, list[Path]] = {}
    for f in sorted(path.glob(f"*/{split}-*.parquet")):
        files.setdefault(f.parent.name, []).append(f)
    return files


def _read(f: Path, subject: str) -> list[Question]:
    if f.suffix == ".parquet":
        return parquet_questions(f, subject, COLUMNS, EXPECTED_LAYOUTS)
    with open(f, newline="", encoding="utf-8-sig") as stream:
        return csv_questions(stream, subject, COLUMNS, str(f), EXPECTED_LAYOUTS)


def load_ceval(path: str | Path, subjects: list[str] | None = None) -> BenchmarkData:
    """The dev and val questions under ``path`` (either layout, detected), restricted to
    ``subjects`` when given."""
    path = data_dir("C-Eval", path, EXPECTED_LAYOUTS)
    parquet = any(path.glob("*/*.parquet"))
    splits = {
        split: {s: [q for f in files for q in _read(f, s)] for s, files in _subject_files(path, split, parquet).items()}
        for split in SPLITS
    }
    data = BenchmarkData("ceval/ceval-exam" if parquet else "csv", splits)
    return checked("C-Eval", path, data, "val", subjects, EXPECTED_LAYOUTS)
