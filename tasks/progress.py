"""A stage's progress shown in the Prefect UI: a progress artifact of the running task."""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from llmflow.progress import Progress, percent

LOG_STEP = 10
"""Percent between the progress lines written to the task run's log."""


def progress_artifact(description: str, key: str | None = None) -> Progress:
    """A ``Progress`` backed by a progress artifact, created now at 0% (``key``: lowercase
    letters, digits and dashes; none shows it on the task run only) and updated each time
    another whole percent is done: one API call per percent, however many batches or steps.
    A detail (tokens/s) goes into the artifact's description, and each further 10% is a line
    of the task run's log."""
    from prefect.logging import get_run_logger

    artifact_id = create_progress_artifact(progress=0.0, key=key, description=description)
    logger = get_run_logger()  # bound to the task run here: reports may come from another thread
    shown = 0

    def report(done: int, total: int, detail: str = "") -> None:
        nonlocal shown
        now = percent(done, total)
        if now > shown:
            update_progress_artifact(artifact_id, progress=float(now),
                                     description=f"{description} ({detail})" if detail else None)
            if now // LOG_STEP > shown // LOG_STEP:
                logger.info("%s: %d%% (%d/%d)%s", description, now, done, total, f", {detail}" if detail else "")
            shown = now

    return report
