"""How every sample asset writes a parquet or a JSON-lines file."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def write_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` as a parquet table, its schema inferred from them."""
    write_parquet(path, pa.Table.from_pylist(rows))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines (UTF-8, non-ASCII characters as they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
