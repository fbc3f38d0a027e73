"""Tonight's scores (the base model's, the SFT model's when an alignment stage followed it,
and the final model's) beside the last registered model's and the previous run's of the same
deployment (last night's, for the nightly schedule), each change with its standard error,
and the regressions: a benchmark that fell by more than two standard errors of the change
since the previous run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from llmflow.tracking import DEPLOYMENT_TAG

REGRESSION_TAG = "llmflow.regression"
"""Tag of a flow's MLflow run: "none", or the benchmarks that regressed, comma-separated."""
REGRESSION_SIGMAS = 2.0


@dataclass(frozen=True)
class ComparisonRow:
    """One benchmark: tonight's scores and the earlier ones they are held against."""

    benchmark: str
    before: float
    """The base model's score."""
    sft: float | None
    """The SFT model's score when an alignment stage followed it (None: the SFT model is the final model)."""
    after: float
    """The final model's score: the aligned model's, else the SFT model's."""
    after_stderr: float | None
    registered: float | None
    """The last registered model's score (before tonight's registration)."""
    previous: float | None
    """The previous run's score after finetuning."""
    change: float | None
    """after - previous."""
    change_stderr: float | None
    """sqrt(stderr tonight² + stderr of the previous run²); tonight's alone when the previous run has none."""
    regression: bool


def previous_run_metrics(flow: str, deployment: str, current_run: str) -> dict[str, float]:
    """The metrics of the latest finished MLflow run of ``flow`` from ``deployment`` in the
    current experiment, other than ``current_run``; empty when there is none."""
    import mlflow

    runs = mlflow.search_runs(
        filter_string=(f"tags.`llmflow.flow` = '{flow}' AND tags.`{DEPLOYMENT_TAG}` = '{deployment}' "
                       "AND attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=5, output_format="list")
    return next((dict(run.data.metrics) for run in runs if run.info.run_id != current_run), {})


def registered_scores(name: str) -> dict[str, float]:
    """The scores tagged on the latest version of the registered model ``name`` (empty when none)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        versions = MlflowClient().search_model_versions(f"name = '{name}'", order_by=["version_number DESC"],
                                                        max_results=1)
    except MlflowException:
        return {}
    scores = {}
    for key, value in (versions[0].tags.items() if versions else ()):
        try:
            scores[key] = float(value)
        except ValueError:
            continue
    return scores


def compare(benchmarks: list[str], scores: dict[str, float], previous: dict[str, float],
            registered: dict[str, float]) -> list[ComparisonRow]:
    """A row per benchmark from tonight's ``scores`` ({b}_before, {b}_sft when there was an
    alignment stage, {b}_after, {b}_after_stderr)."""
    rows = []
    for b in benchmarks:
        after, stderr = scores[f"{b}_after"], scores.get(f"{b}_after_stderr")
        last = previous.get(f"{b}_after")
        change = change_stderr = None
        if last is not None:
            change = after - last
            errors = [e for e in (stderr, previous.get(f"{b}_after_stderr")) if e is not None]
            change_stderr = math.sqrt(sum(e * e for e in errors)) if errors and stderr is not None else None
        regression = change is not None and change_stderr is not None and change < -REGRESSION_SIGMAS * change_stderr
        rows.append(ComparisonRow(b, scores[f"{b}_before"], scores.get(f"{b}_sft"), after, stderr,
                                  registered.get(f"{b}_after"), last, change, change_stderr, regression))
    return rows


def regression_tag(rows: list[ComparisonRow]) -> str:
    """The value of the regression tag."""
    return ",".join(r.benchmark for r in rows if r.regression) or "none"


def comparison_table(rows: list[ComparisonRow]) -> list[dict[str, Any]]:
    """Rows for a Prefect table artifact, an MLflow table and the summary (numbers rounded to 6 places)."""
    return [{key: round(value, 6) if isinstance(value, float) else value for key, value in asdict(row).items()}
            for row in rows]
