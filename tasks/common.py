"""What every stage task shares: its cache policy and the artifact record it returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE
from pydantic import BaseModel

from llmflow.artifacts import read_manifest

# A stage reruns when its inputs or its code change, and is served from cache otherwise:
# retrying a failed flow run skips the stages that finished.
STAGE_CACHE_POLICY = INPUTS + TASK_SOURCE


class StageArtifact(BaseModel):
    """What a finished stage hands to the next: where its output is, and its manifest."""

    stage: str
    """Stage name (download, tokenize-pretrain, ...)."""
    path: str
    """Output directory or file prefix."""
    manifest: dict[str, Any]
    """The manifest the stage wrote last."""


def artifact_for(stage: str, path: str | Path) -> StageArtifact:
    """The record of a stage output that must be complete (its manifest exists)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise RuntimeError(f"stage {stage}: output {path} has no manifest; the stage did not finish")
    return StageArtifact(stage=stage, path=str(path), manifest=manifest)
