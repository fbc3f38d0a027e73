"""Prefect task of the download stage: hub / ModelScope / local directory -> output directory."""

from __future__ import annotations

import time

from prefect import task

from llmflow import tracking
from llmflow.download import DownloadConfig, download, summary
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, artifact_for


@task(name="download", cache_policy=STAGE_CACHE_POLICY + InputFiles(fields=("source",)))
def download_task(config: DownloadConfig) -> StageArtifact:
    """Download (or verify and complete) ``config.out``; returns its artifact record.

    Credentials stay in the environment (HF_TOKEN, MODELSCOPE_API_TOKEN): the MLflow params
    are the config's own, which hold none.
    """
    with tracking.stage_run("download", config.params() | {"out": str(config.out)}) as run_id:
        start = time.monotonic()
        out = download(config)
        tracking.log_metrics(run_id, {**summary(out), "seconds": time.monotonic() - start})
    return artifact_for("download", out)
