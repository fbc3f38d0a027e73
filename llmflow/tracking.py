"""MLflow tracking for stages: one run per stage, nested under the flow's run when there is one.

The tracking URI comes from ``MLFLOW_TRACKING_URI``; without it, a SQLite store under the
workspace (MLflow's file store refuses to start unless explicitly allowed).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def configure(workspace: str | Path = "workspace") -> str:
    """Point MLflow at ``MLFLOW_TRACKING_URI`` or at ``{workspace}/mlflow.db``; returns the URI."""
    import mlflow

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        db = Path(workspace).resolve() / "mlflow.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db}"
    mlflow.set_tracking_uri(uri)
    return uri


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested parameters as MLflow's flat ``a.b`` keys with string values (500 chars max)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:500]
    return flat


@contextlib.contextmanager
def stage_run(stage: str, params: Mapping[str, Any]) -> Iterator[str]:
    """An MLflow run for one stage (nested under the active run, if any), with ``params``
    logged; yields its run id."""
    import mlflow

    nested = mlflow.active_run() is not None
    with mlflow.start_run(run_name=stage, nested=nested, tags={"llmflow.stage": stage}) as run:
        mlflow.log_params(flatten(params))
        yield run.info.run_id


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log to a run by id (works from worker processes without starting a child run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for key, value in metrics.items():
        client.log_metric(run_id, key, float(value), step=step or 0)
