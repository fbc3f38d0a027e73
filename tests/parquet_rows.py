"""Writing rows as a parquet file, as the Hub's dataset layouts hold them (the evaluation tests
build their tiny datasets with it)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path: Path, rows: list[dict]) -> Path:
    """``rows`` as the parquet file ``path`` (its directories made); returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
