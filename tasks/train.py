"""Prefect tasks of the train stage (pretraining or finetuning on torchrun workers) and of the
pair log-probs stage.

The workers stream every output line into the Prefect log as it arrives and log their
step metrics (rank 0) to the stage's MLflow run. When the task fails or its flow run is
cancelled, the whole torchrun process group is killed (``llmflow.launch.run_workers``).

The cache key holds the config (``out`` names the run) and the metadata of the model and
data files, never anything of one attempt: a retry after a failure or a cancellation runs
the same config again, and the workers resume from the last checkpoint in ``out``.

The checkpoint root has no manifest.json: it is a directory that resumes keep writing
into, and each step directory is published by ``latest``, written last. The run is
complete when the step ``latest`` names is ``config.steps``; the artifact's manifest is
that step's meta.

Beside it, the pair log-probs stage (``pair_logps_task``): a model's log-probs of the pairs
of a preference dataset, computed by the same workers in the same layout
(``llmflow.train.reference_worker``) into ``reference_dir(config)`` (``logps.npy``, then
``manifest.json``). It is DPO's reference stage (the initial weights' log-probs of the
training pairs, which the training run then reads instead of computing them) and the flows'
way to score a model on held-out pairs (``reward_accuracy`` of two such arrays). The workers
compute nothing when log-probs with the same fingerprint (the model's and the data's files,
the dtype) are already there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from prefect import get_run_logger, task

from llmflow import runtime, tracking
from llmflow.artifacts import read_manifest
from llmflow.cluster.launcher import LaunchSettings
from llmflow.cluster.nodes import NodeLayout
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact
from llmflow.tasks.progress import progress_artifact
from llmflow.train.command import launch_training
from llmflow.train.config import TrainConfig
from llmflow.train.preflight import check_training
from llmflow.train.reference import STAGE as PAIR_LOGPS_STAGE
from llmflow.train.reference import reference_dir
from llmflow.weights import latest_step_dir, read_meta

STAGE = "train"
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|")


# Where the workers run is no part of the key: a run retried on another launcher resumes the
# same checkpoints.
@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY - "launch" + InputFiles(fields=("model", "data.paths")))
def train_task(config: TrainConfig, nproc: int = 1, device: str | None = None, nnodes: int = 1,
               launch: LaunchSettings | None = None) -> StageArtifact:
    """Train (or resume) ``config`` on ``nproc`` torchrun workers on each of ``nnodes`` nodes
    (of the ``device`` type: cpu, cuda or npu; default: the best one), launched by ``launch``
    (default: the LLMFLOW_LAUNCHER variable, else torchrun on this machine); returns the
    checkpoint root ``config.out`` with the final step's meta. Tracked in MLflow: params are
    the config, metrics the workers' per-step loss, lr, grad_norm, throughput and memory."""
    logger = get_run_logger()
    launch = launch or LaunchSettings()
    device_env = {runtime.DEVICE_ENV: device} if device is not None else {}
    check_training(config, nproc, device_env, nnodes=nnodes, local=launch.on_this_machine, report=logger.info)
    with tracking.stage_run(STAGE, config.model_dump(mode="json") | {"nproc": nproc, "nnodes": nnodes}) as run_id:
        env = tracking.worker_env(run_id) | device_env
        start = time.monotonic()
        out = launch_training(config, nproc, on_line=progress_reporter(logger.info, config.out), env=env,
                              launch=launch, nodes=NodeLayout(nnodes=nnodes))
        artifact = checkpoint_artifact(out, config.steps)
        tracking.log_metrics(run_id, {"seconds": time.monotonic() - start}, step=config.steps)
        log_loss_curve(run_id)
    return artifact


# Like the train stage's, the key holds the config and the model's and data's file metadata,
# never where the workers run.
@task(name=PAIR_LOGPS_STAGE, cache_policy=STAGE_CACHE_POLICY - "launch" + InputFiles(fields=("model", "data.paths")))
def pair_logps_task(config: TrainConfig, nproc: int = 1, device: str | None = None, nnodes: int = 1,
                    launch: LaunchSettings | None = None) -> StageArtifact:
    """The log-probs of ``config.model`` on the pairs of ``config.data`` (a preference dataset),
    computed by ``nproc`` torchrun workers on each of ``nnodes`` nodes in ``config``'s parallel
    layout (``device``: cpu, cuda or npu; default: the best one), launched by ``launch``;
    returns ``reference_dir(config)`` with its manifest. Tracked in MLflow: params are the
    config, metrics the rows, pairs and seconds."""
    logger = get_run_logger()
    launch = launch or LaunchSettings()
    device_env = {runtime.DEVICE_ENV: device} if device is not None else {}
    check_training(config, nproc, device_env, nnodes=nnodes, local=launch.on_this_machine, report=logger.info)
    params = config.model_dump(mode="json") | {"nproc": nproc, "nnodes": nnodes}
    with tracking.stage_run(PAIR_LOGPS_STAGE, params) as run_id:
        env = tracking.worker_env(run_id) | device_env
        start = time.monotonic()
        launch_training(config, nproc, on_line=logger.info, env=env, launch=launch, nodes=NodeLayout(nnodes=nnodes),
                        module="llmflow.train.reference_worker")
        directory = reference_dir(config)
        manifest = read_manifest(directory)
        if manifest is None:
            raise RuntimeError(f"stage {PAIR_LOGPS_STAGE}: {directory} has no manifest; the workers did not finish")
        tracking.log_metrics(run_id, {"rows": manifest["rows"], "pairs": manifest["pairs"],
                                      "seconds": time.monotonic() - start})
    return StageArtifact(stage=PAIR_LOGPS_STAGE, path=str(directory), manifest=manifest)


def progress_reporter(log: Callable[[str], None], out: Path) -> Callable[[str], None]:
    """A worker-line handler that logs each line and moves a Prefect progress artifact with
    every ``step N/M`` line."""
    progress = progress_artifact(f"training {out}")

    def on_line(line: str) -> None:
        log(line)
        match = STEP_LINE.match(line)
        if match:
            progress(int(match[1]), int(match[2]))

    return on_line


def log_loss_curve(run_id: str) -> None:
    """The stage run's loss history as loss_curve.png in its MLflow artifacts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    client = MlflowClient()
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    if not history:
        return
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(*zip(*history))
    axes.set(xlabel="step", ylabel="loss", title="training loss")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    client.log_figure(run_id, figure, "loss_curve.png")
    plt.close(figure)


def checkpoint_artifact(out: Path, steps: int) -> StageArtifact:
    """The artifact record of a finished run: its checkpoint root, with the meta of the
    latest step (which must be step ``steps``) and that step's directory name."""
    step_dir = latest_step_dir(out)
    if step_dir is None:
        raise RuntimeError(f"stage {STAGE}: {out} holds no checkpoint; the run did not finish")
    meta = read_meta(step_dir)
    if meta.step != steps:
        raise RuntimeError(f"stage {STAGE}: the latest checkpoint in {out} is step {meta.step}, the config asks for {steps}")
    return StageArtifact(stage=STAGE, path=str(out), manifest={"step_dir": step_dir.name, **meta.model_dump(mode="json")})
