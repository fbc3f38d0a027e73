"""CMMLU questions from either form it is published in.

- the CSVs: ``{dev,test}/{subject}.csv``, a header row ``,Question,A,B,C,D,Answer`` (the
  first column is the row number);
- ``haonan-li/cmmlu`` (Hugging Face): the same CSVs inside ``cmmlu_v1_0_1.zip``, read from
  the archive without unpacking it.
"""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

from llmflow.evaluate.questions import (
    BenchmarkData,
    Question,
    checked,
    csv_questions,
    data_dir,
)

SPLITS = ("dev", "test")
COLUMNS = ("Question", "A", "B", "C", "D", "Answer")
EXPECTED_LAYOUTS = (
    "the CMMLU CSVs ({dev,test}/{subject}.csv with the header ,Question,A,B,C,D,Answer), "
    "unpacked or inside a .zip archive (haonan-li/cmmlu's cmmlu_v1_0_1.zip)"
)
_MEMBER = re.compile(r"(?:.*/)?(?P<split>dev|test)/(?P<subject>[^/.][^/]*)\.csv")


def _read_dir(path: Path) -> dict[str, dict[str, list[Question]]]:
    splits: dict[str, dict[str, list[Question]]] = {split: {} for split in SPLITS}
    for split in SPLITS:
        for f in sorted(path.glob(f"{split}/*.csv")):
            with open(f, newline="", encoding="utf-8-sig") as stream:
                splits[split][f.stem] = csv_questions(stream, f.stem, COLUMNS, str(f), EXPECTED_LAYOUTS)
    return splits


def _read_zip(archive: Path) -> dict[str, dict[str, list[Question]]]:
    splits: dict[str, dict[str, list[Question]]] = {split: {} for split in SPLITS}
    with zipfile.ZipFile(archive) as z:
        for name in sorted(z.namelist()):
            match = _MEMBER.fullmatch(name)
            if match is None:
                continue
            with io.TextIOWrapper(z.open(name), encoding="utf-8-sig", newline="") as stream:
                where = f"{archive}:{name}"
                questions = csv_questions(stream, match["subject"], COLUMNS, where, EXPECTED_LAYOUTS)
            splits[match["split"]][match["subject"]] = questions
    return splits


def load_cmmlu(path: str | Path, subjects: list[str] | None = None) -> BenchmarkData:
    """The dev and test questions under ``path`` (CSV folders, or a .zip of them), restricted
    to ``subjects`` when given."""
    path = data_dir("CMMLU", path, EXPECTED_LAYOUTS)
    archives = sorted(path.glob("*.zip"))
    if any(path.glob("test/*.csv")) or not archives:
        data = BenchmarkData("csv", _read_dir(path))
    else:
        data = BenchmarkData("zip", _read_zip(archives[0]))
    return checked("CMMLU", path, data, "test", subjects, EXPECTED_LAYOUTS)
