"""Megatron indexed datasets (``{path}.bin`` + ``{path}.idx``), byte-compatible with
megatron-core's ``IndexedDataset`` / ``IndexedDatasetBuilder``.

.idx layout (little endian): b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code, u64
sequence count N, u64 document-index count D (= documents + 1), int32[N] sequence lengths,
int64[N] byte offsets of each sequence in .bin, int64[D] document indices (sequence index
where each document starts, then N). .bin holds the raw tokens back to back.
Pretraining data has one sequence per document, as ``tools/preprocess_data.py`` writes
without sentence splitting; packed instruction data stores each sample as a sequence and
each packed row as a document.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Self

import numpy as np

from llmflow.artifacts import create_temp_file, remove_empty

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """An .idx/.bin pair that is missing or malformed."""


def optimal_token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (Megatron's rule: vocabulary under 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Streams documents into ``{path}.bin`` and writes ``{path}.idx`` on ``finalize``.

    Both files are written beside their final names and renamed in place only when
    finalize succeeds; ``abort`` (or leaving a ``with`` block by an exception) removes them.
    Memory holds one length and one offset per document, never the tokens.
    """

    def __init__(self, path: str | Path, dtype: type) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype} has no Megatron dtype code; expected one of {list(DTYPE_CODES)}")
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._made_dirs = [p for p in self.path.parents if not p.exists()]  # removed again by abort
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._bin_tmp = create_temp_file(Path(f"{self.path}.bin"))
        self._bin = os.fdopen(fd, "wb")
        self._lengths: list[np.ndarray] = []
        self._documents: list[np.ndarray] = []
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray | Iterable[int], lengths: Iterable[int] | None = None) -> None:
        """Append one document: ``tokens`` as a single sequence, or split into sequences of
        ``lengths`` (which must sum to its size), as megatron-core's builder does."""
        tokens = np.asarray(tokens, dtype=self.dtype)
        sizes = np.fromiter(lengths, dtype=np.int64) if lengths is not None else np.array([tokens.size], np.int64)
        if sizes.sum() != tokens.size or (sizes < 0).any():
            raise ValueError(f"sequence lengths {sizes.tolist()} do not split a document of {tokens.size} tokens")
        self._write(tokens, sizes, np.array([sizes.size], np.int64))

    def add_documents(self, documents: Iterable[np.ndarray | Iterable[int]]) -> None:
        """Append documents of one sequence each."""
        arrays = [np.asarray(d, dtype=self.dtype) for d in documents]
        if arrays:
            sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
            self._write(np.concatenate(arrays), sizes, np.ones(len(arrays), np.int64))

    def _write(self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        self._bin.write(tokens.tobytes(order="C"))
        self._lengths.append(lengths)
        self._documents.append(sequences_per_document)
        self.num_tokens += tokens.size

    @property
    def num_documents(self) -> int:
        return sum(len(x) for x in self._documents)

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise IndexedDatasetError(f"{self.path}: a document longer than 2**31-1 tokens cannot be indexed")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.zeros(self.num_documents + 1, dtype=np.int64)
        if self._documents:
            np.cumsum(np.concatenate(self._documents), out=doc_index[1:])
        fd, idx_tmp = create_temp_file(Path(f"{self.path}.idx"))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(INDEX_HEADER)
                f.write(struct.pack("<Q", INDEX_VERSION))
                f.write(struct.pack("<B", DTYPE_CODES[self.dtype.type]))
                f.write(struct.pack("<Q", lengths.size))
                f.write(struct.pack("<Q", doc_index.size))
                f.write(lengths.astype(np.int32).tobytes(order="C"))
                f.write(pointers.tobytes(order="C"))
                f.write(doc_index.tobytes(order="C"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._bin_tmp, f"{self.path}.bin")
            os.replace(idx_tmp, f"{self.path}.idx")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(idx_tmp)
            self.abort()
            raise

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._bin_tmp)
        remove_empty(self._made_dirs)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of ``{path}.bin/.idx`` through memory maps."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        idx_path, bin_path = Path(f"{self.path}.idx"), Path(f"{self.path}.bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise IndexedDatasetError(f"{p}: not found (expected a Megatron .bin/.idx pair at {self.path})")
        with open(idx_path, "rb") as f:
            header = f.read(len(INDEX_HEADER))
            if header != INDEX_HEADER:
                raise IndexedDatasetError(f"{idx_path}: bad header {header!r}; not a Megatron MMIDIDX index")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != INDEX_VERSION:
                raise IndexedDatasetError(f"{idx_path}: index version {version}, expected {INDEX_VERSION}")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in CODE_DTYPES:
                raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}")
            self.dtype = np.dtype(CODE_DTYPES[code])
            (count,) = struct.unpack("<Q", f.read(8))
            (doc_count,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        index = np.memmap(idx_path, mode="r", order="C")
        self.sequence_lengths = np.frombuffer(index, dtype=np.int32, count=count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype=np.int64, count=count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=doc_count, offset=offset)
        self._bin = np.memmap(bin_path, mode="r", order="C") if bin_path.stat().st_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence ``i``, optionally ``length`` tokens starting at ``offset``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.path}")
        length = int(self.sequence_lengths[i]) - offset if length is None else length
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def tokens(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from position ``start`` of the concatenation of all sequences."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens {start}..{start + length} out of range for {self.num_tokens} tokens in {self.path}")
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start * self.dtype.itemsize)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_sequences(self, d: int) -> range:
        """Indices of the sequences document ``d`` is made of."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} out of range for {self.num_documents} documents in {self.path}")
        return range(int(self.document_indices[d]), int(self.document_indices[d + 1]))
