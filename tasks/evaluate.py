"""Prefect tasks of the multiple-choice evaluation stages (MMLU, C-Eval, CMMLU): accuracy as
MLflow metrics, the per-subject table in MLflow and as a Prefect artifact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.artifacts import create_table_artifact

from llmflow import tracking
from llmflow.evaluate import engine
from llmflow.evaluate.benchmarks import CEVAL, CMMLU, MMLU, Benchmark
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, artifact_for


def accuracy_metrics(results: dict[str, Any]) -> dict[str, float]:
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


def evaluate_benchmark(benchmark: Benchmark, config: engine.EvalConfig) -> StageArtifact:
    """Evaluate ``config.model`` on ``benchmark`` into ``config.out`` inside the stage's MLflow
    run; the per-subject table goes to MLflow and to a Prefect table artifact."""
    from mlflow import MlflowClient

    with tracking.stage_run(benchmark.stage, config.model_dump(mode="json")) as run_id:
        artifact = artifact_for(benchmark.stage, engine.evaluate(benchmark, config))
        results = json.loads((Path(artifact.path) / "results.json").read_text())
        tracking.log_metrics(run_id, accuracy_metrics(results))
        table = results_table(results)
        MlflowClient().log_table(run_id, {key: [row[key] for row in table] for key in table[0]},
                                 f"{benchmark.name}_subjects.json")
    create_table_artifact(
        key=f"{benchmark.name}-accuracy",
        table=table,
        description=f"{benchmark.title} accuracy of {config.model} ({config.shots}-shot): {results['accuracy']:.4f}",
    )
    return artifact


def _stage_task(benchmark: Benchmark) -> Task:
    # The benchmark's name is an input of the task, so it is part of the cache key.
    @task(name=benchmark.stage, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("model", "data")))
    def evaluate_task(config: engine.EvalConfig, benchmark_name: str = benchmark.name) -> StageArtifact:
        return evaluate_benchmark(benchmark, config)

    evaluate_task.__doc__ = f"The {benchmark.title} evaluation stage (see ``evaluate_benchmark``)."
    return evaluate_task


EVAL_TASKS: dict[str, Task] = {b.name: _stage_task(b) for b in (MMLU, CEVAL, CMMLU)}
"""Benchmark name -> its Prefect task (stage ``eval-{name}``)."""
