"""How every sample asset writes a parquet file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def write_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` as a parquet table, its schema inferred from them."""
    write_parquet(path, pa.Table.from_pylist(rows))
