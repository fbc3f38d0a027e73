"""An evaluation's progress shown in the Prefect UI: a progress artifact of the running task."""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from llmflow.evaluate.progress import Progress, percent


def progress_artifact(key: str, description: str) -> Progress:
    """A ``Progress`` that creates a progress artifact (``key``: lowercase letters, digits and
    dashes) at the first call and updates it each time another whole percent is done: one API
    call per percent, however many batches."""
    artifact_id = None
    shown = -1

    def report(done: int, total: int) -> None:
        nonlocal artifact_id, shown
        now = percent(done, total)
        if artifact_id is None:
            artifact_id = create_progress_artifact(progress=float(now), key=key, description=description)
        elif now > shown:
            update_progress_artifact(artifact_id, progress=float(now))
        shown = now

    return report
