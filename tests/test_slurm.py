"""The Slurm launcher: its job script (rendered, and read by bash; no cluster), then against a
real two-node Slurm cluster on this machine (munged, slurmctld and two slurmd started by
``slurm_cluster``): ``llmflow train --launcher slurm`` training on two nodes with the losses
of the same run on local torchrun, the finetune-eval flow's launch parameter sending its
train stage to Slurm, a cancelled flow run scancelling its job and the rerun resuming from
the checkpoint, a job whose workers fail failing the stage with its output, a failing
callback cancelling the job, and every output line reaching the callback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect_helpers import checkpoint_after_cancel, flow_run_logs, mlflow_runs, outcome, train_flow_process, wait_for
from pydantic import ValidationError
from slurm_cluster import SlurmCluster, missing_binaries, start_cluster
from train_helpers import assert_close, config, losses, run, training_assets

from llmflow.cluster.launcher import LaunchSettings, WorkerJob
from llmflow.cluster.slurm import (
    SCRIPT_NAME,
    SlurmJobError,
    SlurmSettings,
    exit_status,
    job_script,
    job_state,
    run_slurm,
)
from llmflow.data.indexed import IndexedDatasetWriter
from llmflow.launch import WorkerError
from llmflow.tasks.train import train_task
from llmflow.train.config import TrainConfig
from llmflow.weights import latest_step_dir, read_meta

SUBMITTED = re.compile(r"Slurm job (\d+) submitted")
FAST = SlurmSettings(poll_s=0.5)
"""The launcher's settings in these tests: the job state read twice a second."""


# --- the job script, without a cluster --------------------------------------------------------------


def test_job_script_runs_torchrun_on_every_node_of_the_allocation(tmp_path):
    job = WorkerJob(name="llmflow-train-run1", module="llmflow.train", args=("/shared/runs/run 1/config.json",),
                    nproc_per_node=4, workdir=Path("/shared/runs/run 1"))
    settings = SlurmSettings(partition="gpu", account="proj", qos="high", time="1-00:00:00", gpus_per_node=4,
                             cpus_per_task=32, mem="0", sbatch_options=["--exclusive", "--constraint=a100"],
                             setup=["module load cuda/12.4"], rdzv_port=29400)
    env = {"MLFLOW_RUN_ID": "0123abcd", "MLFLOW_TRACKING_URI": "postgresql://u:p@db/mlflow",
           "NOTE": "a, b  c 'd' \"e\" $HOME `f` \\g"}
    script = job_script(job, 2, settings, env)
    lines = script.splitlines()

    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=llmflow-train-run1",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        '#SBATCH --output="/shared/runs/run 1/slurm-%j.out"',
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --mem=0",
        "#SBATCH --exclusive",
        "#SBATCH --constraint=a100",
    ]
    # The #SBATCH lines come before the first command (sbatch reads no further).
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert "export PYTHONUNBUFFERED=1" in lines
    assert "module load cuda/12.4" in lines
    assert 'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    assert "rdzv_port=29400" in lines
    srun = script[script.index("srun "):].replace("\\\n", " ").split()
    assert srun == [
        "srun", '--nodes="$SLURM_NNODES"', "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL",
        sys.executable, "-m", "torch.distributed.run", '--nnodes="$SLURM_NNODES"', "--nproc-per-node=4",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$first_node:$rdzv_port"', '--rdzv-id="$SLURM_JOB_ID"',
        "-m", "llmflow.train", "'/shared/runs/run", "1/config.json'",
    ]

    # What bash makes of the exports and the worker command: the values exactly as given.
    exports = "\n".join(line for line in lines if line.startswith("export "))
    shown = subprocess.run(
        ["bash", "-c", exports + "\n" + f"{sys.executable} -c 'import json, os, sys; "
         "print(json.dumps({k: os.environ[k] for k in sys.argv[1:]}))' " + " ".join(env) + " PYTHONUNBUFFERED"],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"], "HOME": "/home/x"})
    assert json.loads(shown.stdout) == env | {"PYTHONUNBUFFERED": "1"}
    argv = subprocess.run(["bash", "-c", f"printf '%s\\n' {' '.join(srun[13:])}"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    assert argv == ["-m", "llmflow.train", "/shared/runs/run 1/config.json"]


def test_job_script_defaults_pick_a_free_rendezvous_port_on_the_first_node(tmp_path):
    job = WorkerJob(name="j", module="llmflow.train", args=("c.json",), nproc_per_node=1, workdir=tmp_path)
    lines = job_script(job, 1, SlurmSettings(), {}).splitlines()
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=j", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={tmp_path}/slurm-%j.out"]
    (port_line,) = [line for line in lines if line.startswith("rdzv_port=")]
    port = subprocess.run(["bash", "-c", f"{port_line}; echo $rdzv_port"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert 0 < int(port) < 65536


def test_settings_reject_what_sbatch_would_misread():
    with pytest.raises(ValidationError, match="expected one option"):
        SlurmSettings(sbatch_options=["exclusive"])
    with pytest.raises(ValidationError, match="one option"):
        SlurmSettings(sbatch_options=["--exclusive\n#SBATCH --nodes=9"])
    with pytest.raises(ValidationError, match="one shell line per item"):
        SlurmSettings(setup=["a\nb"])
    with pytest.raises(ValidationError, match="Extra inputs"):
        SlurmSettings(nodes=2)
    with pytest.raises(ValueError, match="not a shell identifier"):
        job_script(WorkerJob("j", "m", (), 1, Path("/w")), 1, SlurmSettings(), {"A B": "1"})
    # Every field has its help text (the CLI's --help and the Prefect form show it).
    assert all(field.description for field in SlurmSettings.model_fields.values())


def test_exit_status_and_error_message_name_the_job():
    assert exit_status("1:0") == 1 and exit_status("0:15") == 143 and exit_status("0:0") == 1
    tail = ["step 3/9 | loss 2.5", "slurmstepd: error: *** JOB 42 ON n1 CANCELLED AT 2026-01-01 DUE TO TIME LIMIT ***"]
    error = SlurmJobError("42", "TIMEOUT", "TimeLimit", 143, tail)
    assert isinstance(error, WorkerError) and error.returncode == 143
    assert str(error).startswith("Slurm job 42 ended TIMEOUT (TimeLimit): workers exited with code 143; last output:")
    assert "DUE TO TIME LIMIT" in str(error)


def test_missing_slurm_commands_are_named_before_anything_is_submitted(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    job = WorkerJob("j", "llmflow.train", ("c.json",), 1, tmp_path / "run")
    with pytest.raises(RuntimeError, match=r"^the Slurm launcher needs .*; missing: sbatch, scontrol, scancel$"):
        run_slurm(job, 1, SlurmSettings(), on_line=print, env={})
    assert not (tmp_path / "run").exists()


# --- against a real cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> SlurmCluster:
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; make system-packages installs it)")
    with start_cluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


@pytest.fixture
def on_cluster(cluster, monkeypatch) -> SlurmCluster:
    """The cluster, found by the launcher through SLURM_CONF; workers on CPU, one thread each."""
    for name, value in cluster.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")
    return cluster


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    return training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("slurm_train"))


def slurm_launch(**settings) -> LaunchSettings:
    return LaunchSettings(launcher="slurm", slurm=FAST.model_copy(update=settings))


def run_workers_of(out: Path) -> list[psutil.Process]:
    """The torchrun agents and ranks training the run in ``out``, wherever they were started."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "llmflow.train" in cmdline and str(out) in cmdline and not cmdline.startswith("srun"):
            found.append(proc)
    return found


@pytest.mark.slow
def test_train_command_runs_on_two_slurm_nodes_with_the_local_losses(on_cluster, assets, tmp_path):
    local = run(config(assets, tmp_path / "local", steps=4), nproc=2)  # two ranks here
    assert sorted(local) == [1, 2, 3, 4]

    out = tmp_path / "on slurm"  # a space in every path the job script names
    path = tmp_path / "train.json"
    path.write_text(config(assets, out, steps=4).model_dump_json())
    workspace = tmp_path / "ws"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run([str(Path(sys.executable).parent / "llmflow"), "train", str(path), "--nnodes", "2",
                           "--nproc", "1", "--launcher", "slurm", "--slurm.poll-s", "0.5", "--workspace", str(workspace)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    streamed = losses(lines)
    assert sorted(streamed) == [1, 2, 3, 4]
    assert_close(streamed, local)

    job_id = next(m[1] for line in lines if (m := SUBMITTED.match(line)))
    job = on_cluster.job(job_id)
    assert job["JobState"] == "COMPLETED" and job["JobName"] == f"llmflow-train-{out.name}"
    assert job["NumNodes"] == "2" and job["BatchHost"] == on_cluster.nodes[0]
    # One torchrun agent on each node, meeting at the first: two ranks of one world.
    assert f"job {job_id}: 2 node(s)" in done.stdout and f"rendezvous at {on_cluster.nodes[0]}:" in done.stdout
    assert (out / SCRIPT_NAME).is_file() and (out / f"slurm-{job_id}.out").is_file()
    assert read_meta(latest_step_dir(out)).step == 4
    # The MLflow run id reached the workers through the job script: rank 0 logged its losses.
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("llmflow-train").experiment_id])
    logged = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "loss")}
    assert logged.keys() == streamed.keys() and all(abs(logged[s] - streamed[s]) < 1e-6 for s in logged)
    assert mlflow_run.data.params["nproc"] == "1" and mlflow_run.data.params["nnodes"] == "2"




@flow(name="test-slurm-train")
def train_flow(config: TrainConfig, launch: LaunchSettings) -> dict:
    return outcome(train_task(config, nproc=2, launch=launch, return_state=True))


def run_train_flow(config: TrainConfig, launch: LaunchSettings) -> tuple[dict, list[str]]:
    state = train_flow(config, launch, return_state=True)
    return state.result(), flow_run_logs(state.state_details.flow_run_id)


@pytest.mark.slow
def test_cancelled_flow_run_scancels_its_job_and_the_retry_resumes(on_cluster, prefect_env, prefect_server, assets,
                                                                   tmp_path):
    out = tmp_path / "run"
    cfg = config(assets, out, steps=24, save_interval=4)
    flow_process = train_flow_process(cfg, 2, slurm_launch(), prefect_server.settings, tmp_path)
    try:
        flow_run_id = wait_for(flow_process.lines, "flow run id").split()[-1]
        job_id = SUBMITTED.search(wait_for(flow_process.lines, "Slurm job")).group(1)
        wait_for(flow_process.lines, f"saved checkpoint {out / 'step_00000004'}")
        assert on_cluster.job(job_id)["JobState"] == "RUNNING"
        assert len(run_workers_of(out)) == 3  # torchrun and two ranks, started by slurmstepd
        assert flow_process.terminate() == []  # SIGTERM, as cancelling the flow run sends
    finally:
        flow_process.close()

    # The launcher scancelled the job and waited for it to end: nothing of it runs.
    assert job_id not in on_cluster.queue()
    assert on_cluster.job(job_id)["JobState"] == "CANCELLED"
    assert run_workers_of(out) == []
    saved = checkpoint_after_cancel(prefect_env, flow_run_id, out, 24)

    # The retry submits a new job, which resumes from the last checkpoint and finishes.
    result, logs = run_train_flow(cfg, slurm_launch())
    assert result["name"] == "Completed", result["message"]
    assert any(line.startswith(f"resumed from {out / f'step_{saved:08d}'} at step {saved}") for line in logs)
    assert sorted(losses(logs)) == list(range(saved + 1, 25))
    assert result["result"].manifest["step"] == 24
    (retry_job,) = {m[1] for line in logs if (m := SUBMITTED.match(line))}
    assert retry_job != job_id and on_cluster.job(retry_job)["JobState"] == "COMPLETED"


@pytest.mark.slow
def test_failing_job_fails_the_stage_with_the_job_and_its_last_lines(on_cluster, prefect_env, assets, tmp_path):
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    writer = IndexedDatasetWriter(tmp_path / "bad_text_document", np.uint16)
    writer.add_documents(np.arange(vocab, vocab + 80, dtype=np.uint16) for _ in range(20))
    writer.finalize()
    cfg = config(assets, tmp_path / "run", steps=3, data={"kind": "pretrain", "paths": [str(tmp_path / "bad")]})

    started = time.monotonic()
    result, logs = run_train_flow(cfg, slurm_launch())
    assert time.monotonic() - started < 120
    assert result["failed"]
    (job_id,) = {m[1] for line in logs if (m := SUBMITTED.match(line))}
    message = result["message"]
    assert f"Slurm job {job_id} ended FAILED" in message and "workers exited with code 1" in message
    assert re.search(r"ValueError: .*bad_text_document sample \d+ .*outside the model vocabulary", message)
    assert any("outside the model vocabulary" in line for line in logs)  # streamed before the failure
    assert on_cluster.job(job_id)["JobState"] == "FAILED" and on_cluster.job(job_id)["ExitCode"] == "1:0"
    assert not (tmp_path / "run" / "latest").exists()
    (mlflow_run,) = mlflow_runs(prefect_env, "train")
    assert mlflow_run.info.status == "FAILED"


@pytest.mark.slow
def test_a_job_sbatch_refuses_is_an_error_naming_sbatch_and_its_reason(on_cluster, tmp_path):
    job = WorkerJob("j", "llmflow.train", ("c.json",), 1, tmp_path)
    with pytest.raises(RuntimeError, match=r"sbatch refused .*invalid partition"):
        run_slurm(job, 1, FAST.model_copy(update={"partition": "nosuch"}), on_line=print, env={})
    assert on_cluster.queue() == []
    # A job the controller does not know, on a cluster without accounting (sacct answers nothing).
    assert job_state("999999") is None


TICKER = """
import sys, time

for i in range(int(sys.argv[2])):
    print(f"tick {i}", flush=True)
    time.sleep(0.2)
print("last line, with no newline after it", end="")
"""


def ticker_job(tmp_path: Path, ticks: int, nproc: int = 1) -> tuple[WorkerJob, dict[str, str]]:
    """A job of a module that prints ``ticks`` lines, one each 0.2 s, then one with no newline;
    its first argument names ``tmp_path`` (to find its processes). Found through PYTHONPATH,
    which reaches the workers through the job script."""
    (tmp_path / "ticker.py").write_text(TICKER)
    job = WorkerJob("ticker", "ticker", (str(tmp_path), str(ticks)), nproc, tmp_path / "work")
    return job, {"PYTHONPATH": str(tmp_path)}


def processes_naming(text: str) -> list[psutil.Process]:
    """The ticker's torchrun agents and workers whose command line holds ``text``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if text in cmdline and "ticker" in cmdline and not cmdline.startswith("srun"):
            found.append(proc)
    return found


@pytest.mark.slow
def test_every_output_line_reaches_the_callback_the_last_one_too(on_cluster, tmp_path):
    job, env = ticker_job(tmp_path, 3)
    lines: list[str] = []
    run_slurm(job, 1, FAST, on_line=lines.append, env=env)
    worker_lines = lines[lines.index(next(line for line in lines if line.startswith("job "))) + 1:]
    assert [line for line in worker_lines if not line.startswith("Slurm job ")] == [
        "tick 0", "tick 1", "tick 2", "last line, with no newline after it"]
    assert re.fullmatch(r"Slurm job \d+ COMPLETED, exit code 0:0", lines[-1])


@pytest.mark.slow
def test_a_failing_callback_cancels_the_job_on_every_node(on_cluster, tmp_path):
    job, env = ticker_job(tmp_path, 300)
    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        if line == "tick 5":
            assert len(processes_naming(str(tmp_path))) == 4  # a torchrun agent and its worker on each node
            raise KeyError("the callback failed")

    with pytest.raises(KeyError, match="the callback failed"):
        run_slurm(job, 2, FAST, on_line=on_line, env=env)
    (job_id,) = {m[1] for line in seen if (m := SUBMITTED.match(line))}
    assert job_id not in on_cluster.queue()
    assert on_cluster.job(job_id)["JobState"] == "CANCELLED"
    assert processes_naming(str(tmp_path)) == []


@pytest.mark.slow
def test_finetune_eval_flow_trains_as_a_slurm_job(on_cluster, prefect_env, tmp_path):
    """The flow's launch parameter, as a deployment or the run form gives it, sends the train
    stage to Slurm; the other stages run in the flow's process."""
    from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval

    params = FinetuneEvalParams.model_validate({
        "workspace": str(tmp_path / "ws"), "version": "test", "evaluation": {"limit": 8},
        "train": {"steps": 4, "save_interval": 4, "micro_batch_size": 8, "global_batch_size": 8},
        "launch": {"launcher": "slurm", "slurm": {"poll_s": 0.5}},
    })
    state = finetune_eval(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    logs = flow_run_logs(state.state_details.flow_run_id)
    (job_id,) = {m[1] for line in logs if (m := SUBMITTED.match(line))}
    assert on_cluster.job(job_id)["JobState"] == "COMPLETED"
    assert 4 in losses(logs)  # the flow logs every 10th step, and the last
    assert on_cluster.job(job_id)["JobName"] == "llmflow-train-" + Path(state.result()["checkpoint"]).name


@pytest.mark.slow
def test_a_job_whose_output_never_appears_says_where_it_looked(on_cluster, tmp_path):
    # The output file where no node can write it: what a run directory that is not shared does.
    job, env = ticker_job(tmp_path, 3)
    settings = FAST.model_copy(update={"sbatch_options": [f"--output={tmp_path / 'missing' / 'x-%j.out'}"]})
    with pytest.raises(SlurmJobError) as failed:
        run_slurm(job, 1, settings, on_line=print, env=env)
    assert failed.value.state == "FAILED"
    assert str(failed.value).endswith(f"the job's output file {tmp_path / 'work' / f'slurm-{failed.value.job_id}.out'} "
                                      f"never appeared: is {tmp_path / 'work'} on storage every node shares, at the "
                                      "same path?")
