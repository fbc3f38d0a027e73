"""One safetensors file, read and written a tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range) and the tensors back to back. Reading from the header alone
with plain file reads (no mmap) and writing the header first lets convert and export move
a model of any size with about one tensor in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from llmflow.weights.errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

TensorSpecs = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Tensor name -> (dtype, shape), in the order the tensors are written."""


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the data from the start of the file."""
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file, by name, from its header alone."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        tensors[name] = StoredTensor(path, dtype, tuple(entry["shape"]), 8 + header_len + begin, end - begin)
    needed = max((t.offset + t.nbytes for t in tensors.values()), default=8 + header_len)
    if path.stat().st_size < needed:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes where its header needs {needed}; the file is truncated")
    return tensors


def read_tensor(stored: StoredTensor, rows: int | None = None) -> torch.Tensor:
    """The tensor, read with a plain file read (no mmap, so the file's pages never count
    against this process); with ``rows``, zero-padded along dim 0 to that many rows. A tensor
    stored encoded (``quantized.DequantizedTensor``) is read decoded, by itself."""
    if not isinstance(stored, StoredTensor):
        return stored.read(rows)
    shape = (rows or stored.shape[0], *stored.shape[1:]) if stored.shape else ()
    tensor = torch.empty(shape, dtype=stored.dtype)
    if rows:
        tensor[stored.shape[0]:].zero_()
    _read_into(stored, stored.offset, memoryview(tensor.view(-1).view(torch.uint8).numpy())[: stored.nbytes])
    return tensor


def read_rows(stored: StoredTensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the tensor (along dim 0, where its bytes are contiguous),
    read alone with a plain file read: a rank holding a shard of a tensor reads its share."""
    if not isinstance(stored, StoredTensor):
        return stored.read_rows(start, stop)
    if not stored.shape:
        return read_tensor(stored)
    if not 0 <= start <= stop <= stored.shape[0]:
        raise ValueError(f"{stored.path}: rows [{start}, {stop}) of a tensor of {stored.shape[0]} rows")
    tensor = torch.empty((stop - start, *stored.shape[1:]), dtype=stored.dtype)
    row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
    _read_into(stored, stored.offset + start * row_bytes, memoryview(tensor.view(-1).view(torch.uint8).numpy()))
    return tensor


def slab(stored: StoredTensor, index: int, start: int, stop: int) -> StoredTensor:
    """Where ``stored[index, start:stop]`` lies (dims 0 and 1; one expert's rows of fused experts),
    read as any stored tensor, alone."""
    if not isinstance(stored, StoredTensor):
        return stored.slab(index, start, stop)
    row_bytes = math.prod(stored.shape[2:]) * stored.dtype.itemsize
    return dataclasses.replace(stored, shape=(stop - start, *stored.shape[2:]), nbytes=(stop - start) * row_bytes,
                               offset=stored.offset + (index * stored.shape[1] + start) * row_bytes)


def _read_into(stored: StoredTensor, offset: int, target: memoryview) -> None:
    with open(stored.path, "rb", buffering=0) as f:
        f.seek(offset)
        while target:
            n = f.readinto(target)
            if not n:
                raise CheckpointError(f"{stored.path}: file ends inside a tensor; the file is truncated")
            target = target[n:]


def safetensors_header(specs: TensorSpecs) -> bytes:
    """The header of a safetensors file whose tensors (name -> dtype, shape) follow it
    back to back in this order, so the data can be written one tensor at a time after it."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def plan_shards(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of ``names`` of at most ``max_bytes`` each (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name in names:
        if shards[-1] and total + sizes[name] > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += sizes[name]
    return shards


def write_safetensors(path: Path, specs: TensorSpecs, tensors: Iterable[torch.Tensor]) -> None:
    """A safetensors file of the tensors ``specs`` describes, ``tensors`` yielding them in
    that order: the header first, then one tensor at a time, so only the tensor being
    written needs to be in memory. A failed write (a full disk) is an OSError naming ``path``."""
    try:
        with open(path, "wb") as f:
            f.write(safetensors_header(specs))
            for (name, (dtype, shape)), tensor in zip(specs.items(), tensors, strict=True):
                if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                    raise ValueError(f"{path}: tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                                     f"its header says {dtype} {shape}")
                f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error
