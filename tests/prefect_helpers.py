"""What the task and flow tests share: task outcomes, a flow run's logs on the server, the
MLflow runs of a stage, and reading a subprocess's lines while it runs."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil


def outcome(state) -> dict[str, Any]:
    """A task or flow state as a plain dict: name, completed, failed, message, result."""
    return {
        "name": state.name,
        "completed": state.is_completed(),
        "failed": state.is_failed(),
        "message": state.message or "",
        "result": state.result(raise_on_failure=False),
    }


def flow_run_logs(flow_run_id) -> list[str]:
    """Messages of the flow run's logs (its tasks' included) on the Prefect server, in order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # send what is still queued
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(log_filter, limit=200, offset=len(messages)):
            messages += [log.message for log in page]
    return messages


def flow_run_artifacts(flow_run_id, kind: str) -> list:
    """The artifacts of type ``kind`` (progress, table, markdown) of the flow run and its tasks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=[kind])))


def task_states(flow_run_id, wait_s: float = 30.0) -> dict[str, list[str]]:
    """Task name -> the state names of its runs in the flow run, in start order. The server
    records a task run from its events, so a run may show without a state, or still Running,
    for a moment after its flow run finished: read again until every run's state is final
    (``wait_s`` at most)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         sort=TaskRunSort.EXPECTED_START_TIME_ASC)
            if all(run.state is not None and run.state.is_final() for run in runs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    states: dict[str, list[str]] = {}
    for run in runs:
        states.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.name)
    return states


def mlflow_runs(env: dict, stage: str) -> list:
    """The runs of ``stage`` in this test's experiment, oldest first."""
    from mlflow import MlflowClient

    client = MlflowClient(env["mlflow_uri"])
    experiment = client.get_experiment_by_name(env["experiment"])
    if experiment is None:
        return []
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{stage}'", order_by=["attributes.start_time ASC"]
    )
    assert all(r.data.tags.get("llmflow.stage", stage) == stage for r in runs)
    return runs


def metric_history(env: dict, run, key: str) -> dict[int, float]:
    """Step -> value of a run's metric; each step logged once (by rank 0 only)."""
    from mlflow import MlflowClient

    history = MlflowClient(env["mlflow_uri"]).get_metric_history(run.info.run_id, key)
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), f"{key} logged more than once per step (by more than rank 0?): {steps}"
    return {m.step: m.value for m in history}


def output_lines(proc: subprocess.Popen) -> queue.Queue[str]:
    """The lines ``proc`` prints, read by a background thread."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue[str], text: str, timeout_s: float = 120) -> str:
    """The first line containing ``text`` (raises queue.Empty after ``timeout_s`` of silence)."""
    while True:
        line = lines.get(timeout=timeout_s)
        if text in line:
            return line


class FlowProcess:
    """A flow run in its own Python process, as a worker or ``serve()`` runs it, on the
    session's Prefect server: its output lines, its torchrun workers, and a SIGTERM (what
    cancelling such a run sends). ``close`` kills whatever is left."""

    def __init__(self, args: list[str], settings: dict) -> None:
        env = {**os.environ, **{setting.name: str(value) for setting, value in settings.items()}, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines = output_lines(self.proc)
        self.workers: list[psutil.Process] = []

    def training_workers(self) -> list[psutil.Process]:
        """The process's torchrun launcher and ranks, remembered for ``terminate`` and ``close``."""
        self.workers = psutil.Process(self.proc.pid).children(recursive=True)
        return [p for p in self.workers if "llmflow.train" in " ".join(p.cmdline())]

    def terminate(self) -> list[psutil.Process]:
        """SIGTERM the flow process, wait for it; returns the workers still alive."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        return [p for p in self.workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for worker in self.workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()


TRAIN_FLOW_SCRIPT = """
import sys

from prefect import flow
from prefect.runtime import flow_run

from llmflow.cluster.launcher import LaunchSettings
from llmflow.tasks.train import train_task
from llmflow.train.config import TrainConfig


@flow(name="test-train-cancelled")
def train_flow(config: TrainConfig, nproc: int, launch: LaunchSettings) -> None:
    print("flow run id", flow_run.id, flush=True)
    train_task(config, nproc=nproc, launch=launch)


if __name__ == "__main__":
    train_flow(TrainConfig.model_validate_json(open(sys.argv[1]).read()), int(sys.argv[2]),
               LaunchSettings.model_validate_json(sys.argv[3]))
"""


def train_flow_process(config, nproc: int, launch, settings: dict, workdir: Path) -> FlowProcess:
    """The train task of ``config`` on ``nproc`` workers per node, launched by ``launch``, in a
    flow run of its own process (which prints its flow run id first)."""
    config_path = workdir / "config.json"
    config_path.write_text(config.model_dump_json())
    script = workdir / "cancelled_flow.py"
    script.write_text(TRAIN_FLOW_SCRIPT)
    return FlowProcess([str(script), str(config_path), str(nproc), launch.model_dump_json()], settings)


def checkpoint_after_cancel(env: dict, flow_run_id: str, out: Path, steps: int) -> int:
    """The step of the last checkpoint a cancelled train flow run left in ``out``, after
    checking that the flow run crashed and the stage's MLflow run failed, mid-training."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.name == "Crashed"
    (cancelled,) = mlflow_runs(env, "train")
    assert cancelled.info.status == "FAILED"
    saved = int((out / "latest").read_text().strip().removeprefix("step_"))
    assert 4 <= saved < steps
    return saved


def attempt_task_states(flow_run_id, attempt: int) -> dict[str, list[str]]:
    """Like ``task_states``, for one attempt of the flow run only: a retried flow run keeps its
    id, and each attempt records new task runs, told apart by ``flow_run_run_count``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                     sort=TaskRunSort.EXPECTED_START_TIME_ASC)
    states: dict[str, list[str]] = {}
    for run in runs:
        if run.flow_run_run_count == attempt:
            states.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.name)
    return states


def wait_for_flow_run(flow_run_id, timeout_s: float = 300, not_state_id=None):
    """The flow run once its state is final (and, with ``not_state_id``, another state than
    that one: the final state before a retry); raises TimeoutError with the last state."""
    import time

    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.is_final() and run.state.id != not_state_id:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {run.state_name} after {timeout_s:.0f} s")
            time.sleep(2)
