"""What every stage task shares: its cache policy and the artifact record it returns."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel

from llmflow import tracking
from llmflow.artifacts import file_stats, read_manifest

# A stage reruns when its inputs or its code change, and is served from cache otherwise:
# retrying a failed flow run skips the stages that finished. Tasks that read local files add
# ``InputFiles`` so that a file changed in place (same path, new content) counts as a new input.
STAGE_CACHE_POLICY = INPUTS + TASK_SOURCE


@dataclass
class InputFiles(CachePolicy):
    """Cache-key part: path, size and mtime of every local file a stage reads, found through
    the ``fields`` of the task's ``config`` (dotted for nested sections: ``data.paths``). A
    field holds a file, a directory (every file under it, hidden ones aside), a file prefix
    (the files named ``{prefix}_*`` or ``{prefix}.*`` beside it, as Megatron datasets are)
    or a list of those. Values that are no local path (``hf://org/name``) add only
    themselves. Only metadata is read, so the key stays cheap for terabyte corpora."""

    fields: tuple[str, ...] = ()

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        config = (inputs or {}).get("config")
        entries: list[Any] = []
        for name in self.fields:
            value = _field(config, name)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if item is not None:
                    entries.extend(file_stats(Path(str(item)).expanduser()))
        return hash_objects(entries, raise_on_failure=True)


def _field(config: Any, dotted: str) -> Any:
    value = config
    for name in dotted.split("."):
        value = value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
    return value


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


def output_summary(manifest: dict[str, Any]) -> dict[str, float]:
    """Files and bytes a stage output's manifest lists."""
    files = manifest.get("files", [])
    return {"files": len(files), "bytes": sum(f["size"] for f in files)}


def run_stage(stage: str, config: BaseModel, run: Callable[[Any], str | Path], metrics: tuple[str, ...]) -> StageArtifact:
    """Run ``run(config)`` inside the stage's MLflow run (params: the config), log the
    ``metrics`` keys of the manifest it wrote with the files, bytes and seconds of the
    output, and return its artifact record."""
    with tracking.stage_run(stage, config.model_dump(mode="json")) as run_id:
        start = time.monotonic()
        artifact = artifact_for(stage, run(config))
        seconds = time.monotonic() - start
        listed = {key: artifact.manifest[key] for key in metrics}
        tracking.log_metrics(run_id, {**output_summary(artifact.manifest), "seconds": seconds, **listed})
    return artifact
