"""Prefect task of the inference stage: throughput in MLflow, and the first prompts with
their outputs as a table in MLflow and as a Prefect table artifact."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from llmflow import tracking
from llmflow.infer.batch import GENERATIONS, STAGE, InferConfig, run_inference
from llmflow.tasks.common import (
    STAGE_CACHE_POLICY,
    InputFiles,
    StageArtifact,
    artifact_for,
)

SAMPLE_ROWS = 20
SAMPLE_TABLE = "infer_samples.json"
METRICS = ("prompts", "prompt_tokens", "generated_tokens", "seconds", "tokens_per_s")


def sample_rows(out: Path, rows: int = SAMPLE_ROWS) -> list[dict[str, Any]]:
    """The first ``rows`` lines of ``out``'s generations.jsonl as table rows (a conversation
    prompt as its JSON text)."""
    table = []
    with open(out / GENERATIONS, encoding="utf-8") as f:
        for line in itertools.islice(f, rows):
            r = json.loads(line)
            prompt = r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"], ensure_ascii=False)
            table.append({"index": r["index"], "prompt": prompt, "output": r["output"],
                          "generated_tokens": r["generated_tokens"], "finish_reason": r["finish_reason"]})
    return table


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("model", "prompts")))
def infer_task(config: InferConfig) -> StageArtifact:
    """Generate for every prompt of ``config.prompts`` into ``config.out``; tracked in MLflow
    (params: the config; metrics: prompts, tokens, tokens/s; the first prompts and outputs as
    a table), the same rows published as a Prefect table artifact."""
    import mlflow

    with tracking.stage_run(STAGE, config.model_dump(mode="json")) as run_id:
        artifact = artifact_for(STAGE, run_inference(config))
        tracking.log_metrics(run_id, {key: artifact.manifest[key] for key in METRICS})
        rows = sample_rows(Path(artifact.path))
        mlflow.log_table({column: [r[column] for r in rows] for column in rows[0]}, SAMPLE_TABLE, run_id=run_id)
    create_table_artifact(
        key="infer-samples",
        table=rows,
        description=f"The first {len(rows)} of {artifact.manifest['prompts']} generations of {config.model} "
        f"({artifact.manifest['tokens_per_s']:.1f} tokens/s)",
    )
    return artifact
