"""Atomic stage outputs and their manifests.

A stage's output is complete when its manifest exists: the manifest is written last, by
rename, after every file it lists. A stage killed part-way leaves its previous good output
(or nothing), never a half-written one that looks complete.

Two shapes of output:
- a directory (download, sample assets, checkpoints): built in a hidden sibling directory
  and renamed into place, with ``manifest.json`` inside;
- a file prefix (Megatron datasets ``{prefix}_text_document.bin/.idx``): each file written
  beside its final name and renamed, then ``{prefix}.manifest.json``.

Outputs get the permissions a plain ``open``/``mkdir`` gives (0o666 / 0o777 less the user's
umask), never tempfile's private 0600 / 0700, so that they stay readable on shared file systems.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llmflow

MANIFEST = "manifest.json"


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path, root: Path, with_hash: bool = True) -> dict[str, Any]:
    """{"path", "size"[, "sha256"]} of ``path`` relative to ``root``."""
    record: dict[str, Any] = {"path": path.relative_to(root).as_posix(), "size": path.stat().st_size}
    if with_hash:
        record["sha256"] = sha256_file(path)
    return record


def file_stats(path: Path) -> list[tuple]:
    """(path, size, mtime_ns) of every file ``path`` stands for: itself, every file under a
    directory (hidden ones aside), or the files named ``{prefix}_*`` or ``{prefix}.*`` beside a
    file prefix (as Megatron datasets are); ``[(path, None)]`` when none is there (not yet, or
    not a local path). Only metadata is read, so the stats stay cheap for terabyte corpora."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = [p for p in sorted(path.rglob("*"))
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    else:
        siblings = path.parent.glob(glob.escape(path.name) + "[._]*") if path.parent.is_dir() else []
        files = sorted(p for p in siblings if p.is_file())
        if not files:
            return [(str(path), None)]
    return [(str(f), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]


def write_json_atomic(path: str | Path, payload: Any) -> Path:
    """Write JSON to ``path`` through a temporary file and a rename."""
    with atomic_file(path, "w") as f:
        json.dump(payload, f, indent=2)
    return Path(path)


def manifest_payload(stage: str, params: dict[str, Any], files: list[dict[str, Any]], **extra: Any) -> dict:
    """The manifest body every stage writes: what ran, with which parameters, what it made."""
    return {
        "stage": stage,
        "llmflow_version": llmflow.__version__,
        "created_unix": time.time(),
        "params": params,
        "files": files,
        **extra,
    }


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """The manifest of a directory output (``path/manifest.json``) or of a prefix output
    (``{path}.manifest.json``); None when the output is not complete."""
    path = Path(path)
    candidate = path / MANIFEST if path.is_dir() else Path(f"{path}.manifest.json")
    if not candidate.is_file():
        return None
    try:
        return json.loads(candidate.read_text())
    except json.JSONDecodeError:
        return None


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield an empty working directory; on success it replaces ``final`` in one rename.

    The caller writes ``manifest.json`` into it last. On any exception the working
    directory is removed and ``final`` is left as it was.
    """
    final = Path(final)
    with created_parents(final):
        work = temp_name(final)
        work.mkdir()
        try:
            yield work
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        replace_directory(work, final)


def temp_name(final: Path) -> Path:
    """A fresh hidden name beside ``final`` to write it under before the rename."""
    return final.with_name(f".{final.name}.tmp-{secrets.token_hex(6)}")


def create_temp_file(final: Path) -> tuple[int, Path]:
    """A new file beside ``final`` (see ``temp_name``), open for writing: ``(fd, path)``. Its
    mode is 0o666 less the umask, as ``open`` would make it (``tempfile.mkstemp``'s is 0600)."""
    tmp = temp_name(final)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp


@contextlib.contextmanager
def created_parents(path: Path) -> Iterator[None]:
    """Create the missing parent directories of ``path``; when the block fails, remove again
    those of them that are still empty, so a failed stage leaves no empty directories behind."""
    missing = [p for p in path.parents if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield
    except BaseException:
        remove_empty(missing)
        raise


def remove_empty(directories: list[Path]) -> None:
    """Remove each directory, in order (deepest first), while it is empty; stop at the first that is not."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def with_filename(error: OSError, path: Path) -> OSError:
    """``error`` when it names its file, else the same error naming ``path``: a failed write
    to an open file (a full disk) names none."""
    if error.filename is not None or error.errno is None:
        return error
    named = OSError(error.errno, error.strerror, str(path))  # OSError picks the subclass of the errno
    named.__cause__ = error
    return named


def replace_directory(source: Path, final: Path) -> None:
    """Move ``source`` to ``final``; a previous ``final`` is set aside first and removed
    only once the new one is in place."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    os.replace(source, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(final: str | Path, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file beside ``final``; on success it is fsynced and renamed to
    ``final``, on failure removed."""
    final = Path(final)
    with created_parents(final):
        fd, tmp = create_temp_file(final)
        try:
            with os.fdopen(fd, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise with_filename(error, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def write_prefix_manifest(manifest: Path, files: list[Path], stage: str, params: dict[str, Any], **extra: Any) -> None:
    """Write the manifest of a prefix output last; if that fails, remove ``files`` so no
    unvouched output stays behind."""
    try:
        root = manifest.parent.resolve()
        records = [file_record(f.resolve(), root) for f in files]
        write_json_atomic(manifest, manifest_payload(stage, params, records, **extra))
    except BaseException:
        for f in files:
            f.unlink(missing_ok=True)
        raise
