"""Stream records out of the corpus formats users have, never loading a whole file.

Supported inputs (chosen by extension, or by being a directory):

- ``.parquet``: read by record batches, only the requested columns;
- ``.jsonl`` / ``.ndjson``: one JSON object per line (blank lines skipped);
- ``.json``: a JSON array of objects, parsed incrementally; a ``.json`` file whose first
  character is not ``[`` is read as JSON lines (what ``datasets.Dataset.to_json`` writes);
- ``.csv``: with a header row, read in blocks, only the requested columns;
- ``.txt``: one document per non-empty line (the line without its line ending), seen as
  a single text column;
- a directory written by ``datasets`` ``save_to_disk`` (a ``Dataset``, or a
  ``DatasetDict`` with a single split), iterated in batches over its memory-mapped arrow files.

``iter_records`` yields ``(row, record)`` with the requested columns; ``iter_texts`` yields
``(row, text)`` of one text column. ``row`` locates the record for error messages: the
1-based line number in jsonl and txt files, the 0-based record index (header excluded) in
every other format; ``describe_row`` words it ("line 7", "row 6").

``validate_input`` checks a file up front (it exists, its format is known, the required
columns are there, it holds at least one record, the first record parses), so a caller
can refuse bad input before writing anything.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SUPPORTED = (".parquet", ".jsonl", ".ndjson", ".json", ".csv", ".txt", "a datasets save_to_disk directory")
LINE_FORMATS = (".jsonl", ".ndjson", ".txt")
_BATCH_ROWS = 1024
_JSON_CHUNK = 1 << 20


class InputError(ValueError):
    """Input text that cannot be read: missing, unknown format, missing column, malformed, empty."""


def describe_row(path: str | Path, row: int) -> str:
    """``row`` as the user would look it up in ``path``: "line N" or "row N"."""
    return f"line {row}" if _format(Path(path)) in LINE_FORMATS or _json_is_lines(Path(path)) else f"row {row}"


def _format(path: Path) -> str:
    if path.is_dir():
        return "hf"
    return path.suffix.lower()


def _json_is_lines(path: Path) -> bool:
    if path.suffix.lower() != ".json" or not path.is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return not stripped.startswith("[")
    return False


def _check_text(path: Path, row: int, value: object, text_key: str) -> str:
    if isinstance(value, str):
        return value
    raise InputError(f"{path}: {describe_row(path, row)}: column {text_key!r} holds {type(value).__name__}, not text")


def _names(columns: str | Sequence[str]) -> list[str]:
    return [columns] if isinstance(columns, str) else list(columns)


def validate_input(path: str | Path, required: str | Sequence[str]) -> None:
    """Raise ``InputError`` unless ``path`` exists, has a supported format, has the
    ``required`` columns and at least one record, and its first record reads."""
    for _ in iter_records(path, _names(required)):
        return
    raise InputError(f"{Path(path)}: empty input (no records)")


def iter_texts(path: str | Path, text_key: str = "text", batch_rows: int = _BATCH_ROWS) -> Iterator[tuple[int, str]]:
    """Yield ``(row, text)`` for every record of ``path``, holding at most one batch in memory."""
    path = Path(path)
    for row, record in iter_records(path, [text_key], batch_rows=batch_rows):
        yield row, _check_text(path, row, record[text_key], text_key)


def iter_records(
    path: str | Path,
    required: Sequence[str],
    optional: Sequence[str] = (),
    batch_rows: int = _BATCH_ROWS,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(row, record)`` for every record of ``path``: a dict with the ``required``
    columns (a record or file without one is an ``InputError`` naming what is there) and
    those ``optional`` columns the record has."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    required, optional = list(required), [c for c in optional if c not in required]
    fmt = _format(path)
    if fmt == "hf":
        yield from _iter_hf(path, required, optional, batch_rows)
    elif fmt == ".parquet":
        yield from _iter_parquet(path, required, optional, batch_rows)
    elif fmt in (".jsonl", ".ndjson"):
        yield from _iter_jsonl(path, required, optional)
    elif fmt == ".json":
        if _json_is_lines(path):
            yield from _iter_jsonl(path, required, optional)
        else:
            yield from _iter_json_array(path, required, optional)
    elif fmt == ".csv":
        yield from _iter_csv(path, required, optional, batch_rows)
    elif fmt == ".txt":
        yield from _iter_txt(path, required)
    else:
        raise InputError(f"{path}: unknown input format {path.suffix or '(no extension)'!r}; supported: {', '.join(SUPPORTED)}")


def _present(path: Path, columns: list[str], required: list[str], optional: list[str]) -> list[str]:
    """The requested columns a schema holds; an ``InputError`` when a required one is missing."""
    missing = [c for c in required if c not in columns]
    if missing:
        raise InputError(f"{path}: no column {missing[0]!r}; columns are {columns}")
    return [c for c in (*required, *optional) if c in columns]


def _rows(path: Path, batch, names: list[str], row: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """Records of an arrow record batch (or table) whose columns are ``names``."""
    for values in zip(*(batch.column(i).to_pylist() for i in range(len(names)))):
        yield row, dict(zip(names, values))
        row += 1


# --- parquet -------------------------------------------------------------------------------


def _iter_parquet(path: Path, required: list[str], optional: list[str], batch_rows: int) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise InputError(f"{path}: not a readable parquet file: {e}") from e
    names = _present(path, pf.schema_arrow.names, required, optional)
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=names):
        yield from _rows(path, batch, names, row)
        row += batch.num_rows


# --- JSON lines and JSON arrays --------------------------------------------------------------


def _select(path: Path, where: str, record: object, required: list[str], optional: list[str]) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise InputError(f"{path}: {where}: expected a JSON object, got {type(record).__name__}")
    for key in required:
        if key not in record:
            raise InputError(f"{path}: {where}: no key {key!r}; keys are {sorted(record)}")
    return {k: record[k] for k in (*required, *optional) if k in record}


def _iter_jsonl(path: Path, required: list[str], optional: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {lineno}: malformed JSON: {e.msg} (column {e.colno})") from e
            yield lineno, _select(path, f"line {lineno}", record, required, optional)


def _iter_json_array(path: Path, required: list[str], optional: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Elements of a top-level JSON array, decoded one at a time from a sliding buffer."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def fill() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(_JSON_CHUNK)
            if not chunk:
                eof = True
                return False
            buf, pos = buf[pos:] + chunk, 0
            return True

        def skip_ws() -> str:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf):
                    return buf[pos]
                if not fill():
                    return ""

        if skip_ws() != "[":
            raise InputError(f"{path}: not a JSON array (a .json file must hold [ {{...}}, ... ] or JSON lines)")
        pos += 1
        row = 0
        if skip_ws() == "]":
            return
        while True:
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    if end == len(buf) and not eof and not isinstance(record, (dict, list, str)):
                        raise ValueError("number may continue in the next chunk")
                    break
                except (json.JSONDecodeError, ValueError) as e:
                    if not fill():
                        msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                        raise InputError(f"{path}: row {row}: malformed JSON array element: {msg}") from e
            pos = end
            yield row, _select(path, f"row {row}", record, required, optional)
            row += 1
            sep = skip_ws()
            if sep == "]":
                return
            if sep != ",":
                raise InputError(f"{path}: after row {row - 1}: expected ',' or ']' in the JSON array, got {sep or 'end of file'!r}")
            pos += 1
            skip_ws()


# --- CSV -------------------------------------------------------------------------------------


def _iter_csv(path: Path, required: list[str], optional: list[str], batch_rows: int) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise InputError(f"{path}: empty input (no header row)")
    names = _present(path, header, required, optional)
    reader = pacsv.open_csv(
        path,
        read_options=pacsv.ReadOptions(block_size=1 << 22),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            include_columns=names, column_types={c: pa.string() for c in names}, strings_can_be_null=False
        ),
    )
    row = 0
    for batch in reader:
        yield from _rows(path, batch, names, row)
        row += batch.num_rows


# --- plain text ------------------------------------------------------------------------------


def _iter_txt(path: Path, required: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    if len(required) != 1:
        raise InputError(f"{path}: a .txt file holds one text per line; columns {required} need a structured format")
    key = required[0]
    with open(path, encoding="utf-8", newline="") as f:
        for lineno, line in enumerate(f, start=1):
            text = line.rstrip("\r\n")
            if text.strip():
                yield lineno, {key: text}


# --- Hugging Face datasets saved with save_to_disk -------------------------------------------


def _iter_hf(path: Path, required: list[str], optional: list[str], batch_rows: int) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise InputError(f"{path}: reading a directory needs the 'datasets' package") from e
    if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json", "dataset_info.json")):
        raise InputError(f"{path}: a directory, but not one written by datasets save_to_disk; supported: {', '.join(SUPPORTED)}")
    try:
        ds = load_from_disk(str(path))
    except Exception as e:
        raise InputError(f"{path}: cannot load the saved dataset: {e}") from e
    if isinstance(ds, DatasetDict):
        if len(ds) != 1:
            raise InputError(f"{path}: a DatasetDict with splits {list(ds)}; pass one split directory, e.g. {path / next(iter(ds))}")
        ds = next(iter(ds.values()))
    assert isinstance(ds, Dataset)
    names = _present(path, ds.column_names, required, optional)
    row = 0
    for batch in ds.select_columns(names).with_format("arrow").iter(batch_size=batch_rows):
        yield from _rows(path, batch, names, row)
        row += batch.num_rows
