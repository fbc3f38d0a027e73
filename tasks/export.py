"""Prefect task of the export stage: training checkpoint -> Hugging Face model directory."""

from __future__ import annotations

from prefect import task

from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, run_stage
from llmflow.weights.export import STAGE, ExportConfig, export


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("ckpt",)))
def export_task(config: ExportConfig) -> StageArtifact:
    """Export the checkpoint ``config.ckpt`` into the Hugging Face directory ``config.out``
    (or a PEFT adapter); tracked in MLflow."""
    return run_stage(STAGE, config, export, ("step",))
