"""MLflow tracking for stages: one run per stage, nested under the flow's run when there is one.

The tracking URI comes from ``MLFLOW_TRACKING_URI``; without it, a SQLite store under the
workspace (MLflow's file store refuses to start unless explicitly allowed). Each flow logs
to an experiment of its own, ``llmflow-{flow}`` (``llmflow train`` from the command line to
``llmflow-train``), on a local store and on a tracking server alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EXPERIMENT = "llmflow"
"""Prefix of the experiments: ``llmflow-{flow}``."""
RUN_ID_ENV = "LLMFLOW_MLFLOW_RUN_ID"
"""The MLflow run that training workers log their step metrics to."""


def experiment_name(flow: str) -> str:
    """The experiment of a flow's (or a command's) runs."""
    return f"{EXPERIMENT}-{flow}"


def configure(workspace: str | Path, experiment: str) -> str:
    """Point MLflow at ``MLFLOW_TRACKING_URI`` or at ``{workspace}/mlflow.db`` and make
    ``experiment`` (``MLFLOW_EXPERIMENT_NAME`` when set) the active one; returns the URI.

    With a local store the experiment keeps its artifacts in ``{workspace}/mlartifacts``:
    MLflow's own default is ``./mlruns`` in whatever directory the process happens to run.
    A tracking server decides that for itself.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    # A new store announces its table creation at INFO on stderr: noise in a command's output.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    root = Path(workspace).resolve()
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        root.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment
    if mlflow.get_experiment_by_name(name) is None:
        location = None if is_server(uri) else (root / "mlartifacts").as_uri()
        try:
            mlflow.create_experiment(name, artifact_location=location)
        except MlflowException as error:  # created meanwhile by another process
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    mlflow.set_experiment(name)
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


FLOW_RUN_TAG = "llmflow.flow_run_id"
DEPLOYMENT_TAG = "llmflow.deployment"


@contextlib.contextmanager
def flow_run(flow: str, flow_run_id: str | None, params: Mapping[str, Any], deployment: str | None = None
             ) -> Iterator[str]:
    """The parent MLflow run of one Prefect flow run, with system metrics on; yields its id.

    A retried flow run keeps its Prefect id, so its parent run is found again by the
    ``llmflow.flow_run_id`` tag and reopened: the stages the retry runs nest beside the
    ones that finished the first time. ``llmflow.deployment`` names the Prefect deployment
    the run came from (empty for a direct call): tonight's run is compared with the previous
    run of its own deployment.
    """
    import mlflow

    found = []
    if flow_run_id:
        found = mlflow.search_runs(filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'", output_format="list",
                                   max_results=1)
    if found:
        context = mlflow.start_run(run_id=found[0].info.run_id, log_system_metrics=True)
    else:
        tags = {"llmflow.flow": flow, FLOW_RUN_TAG: flow_run_id or "", DEPLOYMENT_TAG: deployment or ""}
        context = mlflow.start_run(run_name=flow, tags=tags, log_system_metrics=True)
    with context as run:
        if not found:
            mlflow.log_params(flatten(params))
        yield run.info.run_id


def is_server(uri: str) -> bool:
    """Whether a tracking URI names a tracking server (not a local store)."""
    return uri.startswith(("http://", "https://"))


def run_link(run_id: str) -> str:
    """Where a run is shown: its MLflow UI address when tracking goes to a server, else its id
    and the store."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    if is_server(uri):
        experiment = mlflow.get_run(run_id).info.experiment_id
        return f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
    return f"run {run_id} in {uri}"


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


def set_tags(run_id: str, tags: Mapping[str, str]) -> None:
    """Tag a run by id."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def worker_env(run_id: str) -> dict[str, str]:
    """The environment that makes training workers log their metrics to ``run_id`` in the
    current tracking store."""
    import mlflow

    return {RUN_ID_ENV: run_id, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}
