"""PLACEHOLDER: filled in by the Slurm launcher work."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict


class SlurmSettings(BaseModel):
    """Slurm job settings."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    partition: str | None = None
    """Partition (queue) of the job; the cluster's default when not given."""


def run_slurm(job, nnodes: int, settings: SlurmSettings, on_line: Callable[[str], None], env: dict[str, str]) -> None:
    raise NotImplementedError
