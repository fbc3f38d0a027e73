"""What a launcher runs: one stage's torchrun workers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerJob:
    """One stage's workers: ``python -m module *args`` on ``nproc_per_node`` processes per node."""

    name: str
    """Job name shown by the engine (the stage and its run)."""
    module: str
    args: tuple[str, ...]
    nproc_per_node: int
    workdir: Path
    """A directory on the storage every node shares (the run's output directory), where a batch
    launcher writes its job script and output."""
