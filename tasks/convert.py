"""Prefect task of the convert stage: Hugging Face model directory -> training checkpoint."""

from __future__ import annotations

from prefect import task

from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, run_stage
from llmflow.weights.convert import STAGE, ConvertConfig, convert


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("hf", "megatron")))
def convert_task(config: ConvertConfig) -> StageArtifact:
    """Convert ``config.hf`` into the checkpoint root ``config.out``; tracked in MLflow."""
    return run_stage(STAGE, config, convert, ("vocab_size", "padded_vocab_size"))
