"""Prefect tasks of the evaluation stages: the four-choice benchmarks (MMLU, C-Eval, CMMLU)
with accuracy per subject, and the lm-evaluation-harness task groups (BoolQ, AGIEval, GSM8K,
BBH, HumanEval) with each task's metrics, and GRPO's held-out rewards; the scores as MLflow
metrics, the table in MLflow and as a Prefect artifact, and, while it runs, how far it has got
as a Prefect progress artifact; the settings, chat settings included, are the run's params and
each task's first prompt one of its artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.artifacts import create_table_artifact

from llmflow import tracking
from llmflow.evaluate import engine
from llmflow.evaluate.benchmarks import CEVAL, CMMLU, MMLU, Benchmark
from llmflow.evaluate.choice_engine import ChoiceEvalConfig, evaluate_choices
from llmflow.evaluate.choice_tasks import TaskGroup
from llmflow.evaluate.generative_engine import GenerativeEvalConfig, evaluate_generative
from llmflow.evaluate.generative_tasks import GenerativeGroup
from llmflow.evaluate.reporting import metrics_of
from llmflow.evaluate.rl_rewards import COMPLETIONS, HeldoutRewardsConfig, heldout_rewards
from llmflow.evaluate.rl_rewards import STAGE as HELDOUT_STAGE
from llmflow.evaluate.task_groups import TASK_GROUPS
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, artifact_for
from llmflow.tasks.progress import progress_artifact


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


def log_first_prompts(run_id: str, prompts: dict[str, str]) -> None:
    """Each task's first prompt, exactly as the model saw it, as ``prompts/{task}.txt`` of the run."""
    from mlflow import MlflowClient

    client = MlflowClient()
    for name, prompt in prompts.items():
        client.log_text(run_id, prompt, f"prompts/{name}.txt")


def evaluate_benchmark(benchmark: Benchmark, config: engine.EvalConfig) -> StageArtifact:
    """Evaluate ``config.model`` on ``benchmark`` into ``config.out`` inside the stage's MLflow
    run; the per-subject table goes to MLflow and to a Prefect table artifact."""
    from mlflow import MlflowClient

    progress = progress_artifact(f"{benchmark.title} of {config.model}", f"{benchmark.stage}-progress")
    with tracking.stage_run(benchmark.stage, config.model_dump(mode="json")) as run_id:
        artifact = artifact_for(benchmark.stage, engine.evaluate(benchmark, config, progress))
        results = json.loads((Path(artifact.path) / "results.json").read_text())
        tracking.log_metrics(run_id, accuracy_metrics(results))
        log_first_prompts(run_id, {benchmark.name: results["first_prompt"]})
        table = results_table(results)
        MlflowClient().log_table(run_id, {key: [row[key] for row in table] for key in table[0]},
                                 f"{benchmark.name}_subjects.json")
    create_table_artifact(
        key=f"{benchmark.name}-accuracy",
        table=table,
        description=f"{benchmark.title} accuracy of {config.model} ({config.shots}-shot): {results['accuracy']:.4f}",
    )
    return artifact


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics of an lm-evaluation-harness group's results.json: the headline as accuracy,
    each task's metrics and their standard errors, the group's averages, sample count and throughput."""
    metrics = {"accuracy": float(results["headline"]["value"]), "samples": float(sum(
        t["samples"] for t in results["tasks"].values())), "samples_per_s": float(results["samples_per_s"] or 0.0)}
    for name, task_scores in results["tasks"].items():
        for metric in metrics_of(task_scores):
            metrics.update({f"{key}/{name}": float(task_scores[key]) for key in (metric, f"{metric}_stderr")
                            if task_scores[key] is not None})
    for metric, averages in (results.get("group") or {}).items():
        if isinstance(averages, dict):
            metrics.update({f"{metric}/{average}": float(v) for average, v in averages.items() if v is not None})
    return metrics


def task_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task: its samples and each metric with its standard error."""
    rows = []
    for name, t in results["tasks"].items():
        values = {key: round(t[key], 4) if t[key] is not None else None
                  for metric in metrics_of(t) for key in (metric, f"{metric}_stderr")}
        rows.append({"task": name, "samples": t["samples"], **values})
    return rows


def evaluate_group(group: TaskGroup | GenerativeGroup, config: ChoiceEvalConfig | GenerativeEvalConfig) -> StageArtifact:
    """Evaluate ``config.model`` on ``group``'s tasks into ``config.out`` inside the stage's
    MLflow run; the per-task table goes to MLflow and to a Prefect table artifact."""
    from mlflow import MlflowClient

    evaluate = evaluate_choices if isinstance(group, TaskGroup) else evaluate_generative
    progress = progress_artifact(f"{group.title} of {config.model}", f"{group.stage}-progress")
    with tracking.stage_run(group.stage, config.model_dump(mode="json")) as run_id:
        artifact = artifact_for(group.stage, evaluate(group, config, progress))
        results = json.loads((Path(artifact.path) / "results.json").read_text())
        tracking.log_metrics(run_id, task_metrics(results))
        log_first_prompts(run_id, {name: t["first_prompt"] for name, t in results["tasks"].items()})
        table = task_table(results)
        MlflowClient().log_table(run_id, {key: [row[key] for row in table] for key in table[0]}, f"{group.name}_tasks.json")
    headline = results["headline"]
    create_table_artifact(
        key=f"{group.name}-scores", table=table,
        description=(f"{group.title} of {config.model}: {headline['metric']} "
                     f"{headline['value']:.4f}" + (f" ({headline['average']} average)" if headline["average"] else "")),
    )
    return artifact


def _stage_task(name: str, title: str, run_stage) -> Task:
    # The benchmark's name is an input of the task, so it is part of the cache key.
    @task(name=f"eval-{name}", cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("model", "data")))
    def evaluate_task(config: engine.EvalConfig | ChoiceEvalConfig | GenerativeEvalConfig,
                      benchmark_name: str = name) -> StageArtifact:
        return run_stage(config)

    evaluate_task.__doc__ = f"The {title} evaluation stage."
    return evaluate_task


EVAL_TASKS: dict[str, Task] = {
    **{b.name: _stage_task(b.name, b.title, lambda config, b=b: evaluate_benchmark(b, config)) for b in (MMLU, CEVAL, CMMLU)},
    **{g.name: _stage_task(g.name, g.title, lambda config, g=g: evaluate_group(g, config))
       for g in TASK_GROUPS.values()},
}
"""Benchmark name -> its Prefect task (stage ``eval-{name}``)."""


@task(name=HELDOUT_STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("model", "prompts")))
def heldout_rewards_task(config: HeldoutRewardsConfig) -> StageArtifact:
    """The held-out reward stage: a model's greedy completions of held-out prompts scored by
    GRPO's reward functions, the scores in the stage's MLflow run and a table of the first
    completions as a Prefect artifact."""
    with tracking.stage_run(HELDOUT_STAGE, config.model_dump(mode="json")) as run_id:
        artifact = artifact_for(HELDOUT_STAGE, heldout_rewards(config))
        manifest = artifact.manifest
        tracking.log_metrics(run_id, {key: float(manifest[key]) for key in ("reward", "reward_accuracy", "prompts")})
    lines = (Path(artifact.path) / COMPLETIONS).read_text(encoding="utf-8").splitlines()[:20]
    rows = [json.loads(line) for line in lines]
    create_table_artifact(
        key="heldout-rewards",
        table=[{"row": r["where"], "completion": r["completion"], **r["rewards"]} for r in rows],
        description=f"held-out rewards of {config.model}: reward accuracy {manifest['reward_accuracy']:.4f}",
    )
    return artifact
