"""Prefect task of the precision-compare stage: two msprobe-format dumps compared, the
verdict and the worst rows published to MLflow and as Prefect artifacts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from llmflow import tracking
from llmflow.probe.compare.reading import PASS
from llmflow.probe.compare.rows import Row
from llmflow.probe.compare.tables import STAGE, CompareConfig, compare_dumps
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, artifact_for

WORST_ROWS = 20
SEVERITY = {"error": 0, "warning": 1}


def worst_rows(rows: list[Row], limit: int = WORST_ROWS) -> list[dict[str, Any]]:
    """The rows that are not pass, errors first, each in execution order."""
    failing = sorted((row for row in rows if row.result in SEVERITY), key=lambda row: SEVERITY[row.result])
    return [{"name": row.leaf.name, "result": row.result, "message": "; ".join(row.messages)[:300]}
            for row in failing[:limit]]


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("target", "bench")))
def compare_task(config: CompareConfig) -> StageArtifact:
    """Compare ``config.target`` with ``config.bench`` into ``config.out``; per-result row
    counts as MLflow metrics, the advisor's text and the worst rows as artifacts."""
    from mlflow import MlflowClient

    with tracking.stage_run(STAGE, config.model_dump(mode="json")) as run_id:
        report = compare_dumps(config)
        rows = [row for rank in report.ranks for row in rank.rows]
        counts = Counter(row.result for row in rows)
        tracking.log_metrics(run_id, {"rows": len(rows), **{f"rows_{result}": n for result, n in counts.items()}})
        MlflowClient().log_text(run_id, report.advice, "advisor.txt")
    worst = worst_rows(rows)
    verdict = "every row passes" if counts[PASS] == len(rows) else f"{len(rows) - counts[PASS]} of {len(rows)} rows do not pass"
    create_markdown_artifact(key="precision-advice", markdown=f"# Precision: {verdict}\n\n```\n{report.advice}\n```\n",
                             description=f"{config.target} against {config.bench}")
    if worst:
        create_table_artifact(key="precision-worst-rows", table=worst, description="rows that do not pass, errors first")
    return artifact_for(STAGE, report.out)
