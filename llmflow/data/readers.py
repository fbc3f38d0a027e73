"""Stream text records out of the corpus formats users have, never loading a whole file.

Supported inputs (chosen by extension, or by being a directory):

- ``.parquet``: read by record batches, only the text column;
- ``.jsonl`` / ``.ndjson``: one JSON object per line (blank lines skipped);
- ``.json``: a JSON array of objects, parsed incrementally; a ``.json`` file whose first
  character is not ``[`` is read as JSON lines (what ``datasets.Dataset.to_json`` writes);
- ``.csv``: with a header row, read in blocks, only the text column;
- ``.txt``: one document per non-empty line (the line without its line ending);
- a directory written by ``datasets`` ``save_to_disk`` (a ``Dataset``, or a
  ``DatasetDict`` with a single split), iterated in batches over its memory-mapped arrow files.

``iter_texts`` yields ``(row, text)``. ``row`` locates the record for error messages:
the 1-based line number in jsonl and txt files, the 0-based record index (header
excluded) in every other format; ``describe_row`` words it ("line 7", "row 6").

``validate_input`` checks a file up front (it exists, its format is known, the text column
is there, it holds at least one record, the first record parses), so a caller can refuse
bad input before writing anything.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

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


def _check_text(path: Path, row: int, value: object, text_key: str, where: str | None = None) -> str:
    if isinstance(value, str):
        return value
    where = where or describe_row(path, row)
    raise InputError(f"{path}: {where}: column {text_key!r} holds {type(value).__name__}, not text")


def validate_input(path: str | Path, text_key: str) -> None:
    """Raise ``InputError`` unless ``path`` exists, has a supported format, has the
    ``text_key`` column and at least one record, and its first record reads."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    fmt = _format(path)
    if fmt == "hf":
        _hf_dataset(path, text_key)  # checks the column and the row count
    elif fmt == ".parquet":
        _parquet_check(path, text_key)
    elif fmt == ".csv":
        _csv_columns(path, text_key)
    elif fmt not in (".jsonl", ".ndjson", ".json", ".txt"):
        raise InputError(f"{path}: unknown input format {path.suffix or '(no extension)'!r}; supported: {', '.join(SUPPORTED)}")
    # Reading the first record checks what the schema check cannot (jsonl keys, emptiness).
    for _ in iter_texts(path, text_key):
        return
    raise InputError(f"{path}: empty input (no records)")


def iter_texts(path: str | Path, text_key: str = "text", batch_rows: int = _BATCH_ROWS) -> Iterator[tuple[int, str]]:
    """Yield ``(row, text)`` for every record of ``path``, holding at most one batch in memory."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    fmt = _format(path)
    if fmt == "hf":
        yield from _iter_hf(path, text_key, batch_rows)
    elif fmt == ".parquet":
        yield from _iter_parquet(path, text_key, batch_rows)
    elif fmt in (".jsonl", ".ndjson"):
        yield from _iter_jsonl(path, text_key)
    elif fmt == ".json":
        yield from (_iter_jsonl(path, text_key) if _json_is_lines(path) else _iter_json_array(path, text_key))
    elif fmt == ".csv":
        yield from _iter_csv(path, text_key, batch_rows)
    elif fmt == ".txt":
        yield from _iter_txt(path)
    else:
        raise InputError(f"{path}: unknown input format {path.suffix or '(no extension)'!r}; supported: {', '.join(SUPPORTED)}")


# --- parquet -------------------------------------------------------------------------------


def _parquet_check(path: Path, text_key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise InputError(f"{path}: not a readable parquet file: {e}") from e
    names = pf.schema_arrow.names
    if text_key not in names:
        raise InputError(f"{path}: no column {text_key!r}; columns are {names}")
    typ = pf.schema_arrow.field(text_key).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)):
        raise InputError(f"{path}: column {text_key!r} has type {typ}, not string")
    return pf


def _iter_parquet(path: Path, text_key: str, batch_rows: int) -> Iterator[tuple[int, str]]:
    pf = _parquet_check(path, text_key)
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            yield row, _check_text(path, row, value, text_key)
            row += 1


# --- JSON lines and JSON arrays --------------------------------------------------------------


def _record_text(path: Path, where: str, record: object, text_key: str) -> str:
    if not isinstance(record, dict):
        raise InputError(f"{path}: {where}: expected a JSON object, got {type(record).__name__}")
    if text_key not in record:
        raise InputError(f"{path}: {where}: no key {text_key!r}; keys are {sorted(record)}")
    return _check_text(path, 0, record[text_key], text_key, where)


def _iter_jsonl(path: Path, text_key: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {lineno}: malformed JSON: {e.msg} (column {e.colno})") from e
            yield lineno, _record_text(path, f"line {lineno}", record, text_key)


def _iter_json_array(path: Path, text_key: str) -> Iterator[tuple[int, str]]:
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
            yield row, _record_text(path, f"row {row}", record, text_key)
            row += 1
            sep = skip_ws()
            if sep == "]":
                return
            if sep != ",":
                raise InputError(f"{path}: after row {row - 1}: expected ',' or ']' in the JSON array, got {sep or 'end of file'!r}")
            pos += 1
            skip_ws()


# --- CSV -------------------------------------------------------------------------------------


def _csv_columns(path: Path, text_key: str) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise InputError(f"{path}: empty input (no header row)")
    if text_key not in header:
        raise InputError(f"{path}: no column {text_key!r}; columns are {header}")
    return header


def _iter_csv(path: Path, text_key: str, batch_rows: int) -> Iterator[tuple[int, str]]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    _csv_columns(path, text_key)
    reader = pacsv.open_csv(
        path,
        read_options=pacsv.ReadOptions(block_size=1 << 22),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            include_columns=[text_key], column_types={text_key: pa.string()}, strings_can_be_null=False
        ),
    )
    row = 0
    for batch in reader:
        for value in batch.column(0).to_pylist():
            yield row, _check_text(path, row, value, text_key)
            row += 1


# --- plain text ------------------------------------------------------------------------------


def _iter_txt(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        for lineno, line in enumerate(f, start=1):
            text = line.rstrip("\r\n")
            if text.strip():
                yield lineno, text


# --- Hugging Face datasets saved with save_to_disk -------------------------------------------


def _hf_dataset(path: Path, text_key: str):
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise InputError(f"{path}: reading a directory needs the 'datasets' package") from e
    if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json", "dataset_info.json")):
        raise InputError(f"{path}: a directory, but not one written by datasets save_to_disk; supported: {', '.join(SUPPORTED)}")
    try:
        ds = load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001
        raise InputError(f"{path}: cannot load the saved dataset: {e}") from e
    if isinstance(ds, DatasetDict):
        if len(ds) != 1:
            raise InputError(f"{path}: a DatasetDict with splits {list(ds)}; pass one split directory, e.g. {path / next(iter(ds))}")
        ds = next(iter(ds.values()))
    assert isinstance(ds, Dataset)
    if text_key not in ds.column_names:
        raise InputError(f"{path}: no column {text_key!r}; columns are {ds.column_names}")
    return ds


def _iter_hf(path: Path, text_key: str, batch_rows: int) -> Iterator[tuple[int, str]]:
    ds = _hf_dataset(path, text_key).select_columns([text_key])
    row = 0
    for batch in ds.iter(batch_size=batch_rows):
        for value in batch[text_key]:
            yield row, _check_text(path, row, value, text_key)
            row += 1
