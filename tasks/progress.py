"""A stage's progress shown in the Prefect UI: a progress artifact of the running task."""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from llmflow.progress import Progress, percent


def progress_artifact(description: str, key: str | None = None) -> Progress:
    """A ``Progress`` backed by a progress artifact, created now at 0% (``key``: lowercase
    letters, digits and dashes; none shows it on the task run only) and updated each time
    another whole percent is done: one API call per percent, however many batches or steps."""
    artifact_id = create_progress_artifact(progress=0.0, key=key, description=description)
    shown = 0

    def report(done: int, total: int) -> None:
        nonlocal shown
        now = percent(done, total)
        if now > shown:
            update_progress_artifact(artifact_id, progress=float(now))
            shown = now

    return report
