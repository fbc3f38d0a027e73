"""Prefect task of the register stage: an exported model into the MLflow model registry."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from prefect import task

from llmflow import tracking
from llmflow.tasks.common import STAGE_CACHE_POLICY, StageArtifact

STAGE = "register"


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY)
def register_model_task(name: str, model: StageArtifact, scores: Mapping[str, float]) -> dict[str, str]:
    """Register the Hugging Face directory ``model.path`` as a new version of the registered
    model ``name``, tagged with ``scores`` and linked to the stage's MLflow run. With a local
    store the version references the directory in place (models are gigabytes; the workspace
    already holds them with a manifest); a tracking server only accepts its own artifacts,
    so there the directory is uploaded first. Cached on its inputs: a rerun of an unchanged flow registers nothing new."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    with tracking.stage_run(STAGE, {"name": name, "model": model.path, **scores}) as run_id:
        try:
            client.create_registered_model(name, description="Models exported by llmflow flows, with their scores.")
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = {key: f"{value:.6g}" for key, value in scores.items()}
        source = str(Path(model.path).resolve())
        if tracking.is_server(client.tracking_uri):
            # A tracking server accepts only sources inside the run's artifacts: upload the model.
            client.log_artifacts(run_id, source, "model")
            source = f"runs:/{run_id}/model"
        version = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
        tracking.log_metrics(run_id, dict(scores))
    return {"name": name, "version": str(version.version), "source": version.source}
