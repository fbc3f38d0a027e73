"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` and ``*.distcp`` files, saved
and loaded collectively under a process group or by one process alone, with the user's
errors (a missing or truncated file, a full disk) reported as themselves rather than as
DCP's wrapper.

torch.distributed.checkpoint (and the DTensor it brings) is imported where it is used: it
costs a second of start-up that commands loading a Hugging Face model never need.
"""

from __future__ import annotations

import errno
import os
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.artifacts import with_filename
from llmflow.weights.errors import CheckpointError
from llmflow.weights.process_group import distributed

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlanner

DCP_METADATA = ".metadata"


def read_dcp_metadata(directory: Path) -> Metadata:
    """The DCP metadata of a step directory; CheckpointError naming the file when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            f"{directory / DCP_METADATA}: cannot read the checkpoint's metadata ({type(error).__name__}: {error}); "
            "the step directory is incomplete or damaged"
        ) from error


def check_dcp_files(directory: Path) -> None:
    """Refuse a DCP directory whose data files are missing or shorter than its metadata says
    (a copy cut short), naming the first such file, before anything is read."""
    needed: dict[str, int] = {}
    for info in read_dcp_metadata(directory).storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the checkpoint step directory is incomplete")
        if path.stat().st_size < size:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes where the checkpoint's metadata needs {size}; the file is truncated"
            )


def _unwrapped(error: CheckpointException, directory: Path) -> BaseException:
    """The error of the first failed rank when it is the user's (a file that cannot be read or
    written, a CheckpointError), else ``error`` itself: DCP wraps every failure in its own type."""
    failure = next(iter(error.failures.values()))[0]
    if isinstance(failure, OSError):
        return with_filename(failure, directory)
    if isinstance(failure, RuntimeError) and directory.exists() and os.statvfs(directory).f_bavail == 0:
        # torch.save's writer reports a write that hit a full disk as a RuntimeError without errno
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return failure if isinstance(failure, CheckpointError) else error


def dcp_save(state: dict[str, Any], directory: Path, writer: FileSystemWriter | None = None,
             planner: SavePlanner | None = None) -> None:
    """``dcp.save`` of ``state`` into ``directory``: collective under a process group, a
    plain local save without one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(state, storage_writer=writer or dcp.FileSystemWriter(str(directory)), planner=planner,
                     no_dist=not distributed())
        except CheckpointException as error:
            raise _unwrapped(error, directory) from error


def dcp_load(state: dict[str, Any], directory: Path, collective: bool = True) -> None:
    """``dcp.load`` into ``state`` in place; collective under a process group unless
    ``collective`` is False (one process reading for itself)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_dcp_files(directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=not (collective and distributed()))
        except CheckpointException as error:
            raise _unwrapped(error, directory) from error
