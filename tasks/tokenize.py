"""Prefect tasks for the tokenize stages."""

from __future__ import annotations

from prefect import task

from llmflow import tracking
from llmflow.data.tokenize_pretrain import STAGE, PretrainTokenizeConfig, tokenize_pretrain
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, artifact_for


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("input", "tokenizer")))
def tokenize_pretrain_task(config: PretrainTokenizeConfig) -> StageArtifact:
    """Tokenize pretraining text into ``{out}_text_document.bin/.idx``; tracked in MLflow."""
    params = config.model_dump(mode="json")
    with tracking.stage_run(STAGE, params) as run_id:
        out = tokenize_pretrain(config)
        artifact = artifact_for(STAGE, out)
        m = artifact.manifest
        tracking.log_metrics(
            run_id, {"documents": m["documents"], "tokens": m["tokens"], "tokens_per_s": m["tokens_per_s"]}
        )
    return artifact
