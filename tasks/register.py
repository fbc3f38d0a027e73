"""Prefect task of the register stage: an exported model into the MLflow model registry,
behind the gate that keeps models which score worse than the model they were trained from out of it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from llmflow import tracking
from llmflow.tasks.common import STAGE_CACHE_POLICY, StageArtifact

STAGE = "register"
GATE_TAG = "llmflow.registry.gate"
"""Tag of a flow's MLflow run: "passed", "failed" or "off" (registered whatever the score)."""
REASON_TAG = "llmflow.registry.reason"
"""Tag of a flow's MLflow run: why the gate passed or failed."""
SCORE_TOLERANCE = 1e-9
"""Gains are compared to within this: scores are fractions of question counts, and 0.26 - 0.25
is 0.010000000000000009 in floating point."""


class RegistryGate(BaseModel):
    """Whether a finetuned model may be registered, and why."""

    passed: bool
    """The model may be registered."""
    reason: str
    """The scores and the rule they were held to."""
    rule: str
    """min_gain=X, or "always"."""

    def tags(self) -> dict[str, str]:
        """The gate as MLflow tags of the flow's run."""
        state = "off" if self.rule == "always" else "passed" if self.passed else "failed"
        return {GATE_TAG: state, REASON_TAG: self.reason}


def registry_gate(before: float, after: float, min_gain: float | None, benchmark: str = "MMLU",
                  models: tuple[str, str] | None = None) -> RegistryGate:
    """The gate for a model scoring ``after`` on ``benchmark`` whose reference model (its base
    model, or the SFT model an aligned model started from) scored ``before``: it passes when
    ``after - before`` is at least ``min_gain``; ``min_gain`` None passes always. ``models``
    names the two in the reason (("SFT", "dpo"): "MMLU SFT 0.7200 -> dpo 0.3800"); None: the
    base model and its finetune, unnamed."""
    reference, model = (f"{name} " for name in models) if models else ("", "")
    scores = f"{benchmark} {reference}{before:.4f} -> {model}{after:.4f} ({after - before:+.4f})"
    if min_gain is None:
        return RegistryGate(passed=True, reason=f"{scores}; registered whatever the score", rule="always")
    passed = after - before >= min_gain - SCORE_TOLERANCE
    verdict = "meets the minimum gain {:+.4f}" if passed else "is below the minimum gain {:+.4f}: not registered"
    return RegistryGate(passed=passed, reason=f"{scores} {verdict.format(min_gain)}", rule=f"min_gain={min_gain:g}")


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
