"""Prefect task of the MMLU evaluation stage: accuracy in MLflow, the per-subject table as a
Prefect artifact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmflow.tasks.common import (
    STAGE_CACHE_POLICY,
    InputFiles,
    StageArtifact,
    artifact_for,
)
from prefect import task
from prefect.artifacts import create_table_artifact

from llmflow import tracking
from llmflow.evaluate.mmlu import STAGE, MMLUConfig, evaluate_mmlu


def mmlu_metrics(results: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics of a results.json: accuracy overall, per category and per subject,
    question count and throughput."""
    metrics = {key: float(results[key]) for key in ("accuracy", "questions", "questions_per_s")}
    for group in ("categories", "subjects"):
        metrics.update({f"accuracy/{name}": v["accuracy"] for name, v in results[group].items()})
    return metrics


def results_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per subject (subject, category, questions, accuracy), then the overall row."""
    rows = [{"subject": s, "category": v["category"], "questions": v["questions"], "accuracy": round(v["accuracy"], 4)}
            for s, v in results["subjects"].items()]
    rows.append({"subject": "all", "category": "", "questions": results["questions"], "accuracy": round(results["accuracy"], 4)})
    return rows


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("model", "data")))
def evaluate_mmlu_task(config: MMLUConfig) -> StageArtifact:
    """Evaluate ``config.model`` on MMLU into ``config.out``; tracked in MLflow, the
    per-subject accuracy published as a table artifact."""
    with tracking.stage_run(STAGE, config.model_dump(mode="json")) as run_id:
        artifact = artifact_for(STAGE, evaluate_mmlu(config))
        results = json.loads((Path(artifact.path) / "results.json").read_text())
        tracking.log_metrics(run_id, mmlu_metrics(results))
    create_table_artifact(
        key="mmlu-accuracy",
        table=results_table(results),
        description=f"MMLU accuracy of {config.model} ({config.shots}-shot): {results['accuracy']:.4f}",
    )
    return artifact
