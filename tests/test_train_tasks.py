"""The convert, export and train tasks inside flows, against the temporary Prefect server:
artifact records and MLflow runs, the workers' lines in the Prefect log and their step
metrics in the stage's MLflow run, a failing worker failing the task with its error; and
``llmflow train`` from the command line tracked in MLflow as the train stage is. (A flow run
cancelled mid-training, leaving no worker behind, and its rerun resuming from the checkpoint:
tests/test_flows.py.)

Every torchrun launch costs 6-9 s here, so there are three, on a model of a few thousand
parameters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from prefect import flow
from prefect_helpers import (
    flow_run_artifacts,
    flow_run_logs,
    metric_history,
    mlflow_runs,
    outcome,
)

from llmflow.artifacts import read_manifest
from llmflow.data.indexed import IndexedDatasetWriter
from llmflow.models import CausalLM, ModelConfig
from llmflow.tasks.common import InputFiles, StageArtifact
from llmflow.tasks.convert import convert_task
from llmflow.tasks.export import export_task
from llmflow.tasks.train import progress_reporter, train_task
from llmflow.train.config import TrainConfig
from llmflow.weights import read_meta, save_hf_model
from llmflow.weights.convert import ConvertConfig
from llmflow.weights.export import ExportConfig
from llmflow.weights.hf import safetensors_files

VOCAB = 96
HF_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([0-9.]+)")

# A flow run in its own process, as a worker or serve() runs it: cancelling it sends SIGTERM.

pytestmark = pytest.mark.usefixtures("prefect_env")


@pytest.fixture(autouse=True)
def worker_env(monkeypatch):
    """Workers on CPU, one thread each (two ranks share two cores)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 model (Hugging Face directory) and a pretraining corpus of random ids."""
    root = tmp_path_factory.mktemp("train_tasks")
    model = CausalLM(ModelConfig.from_hf(HF_CONFIG))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_model(model, root / "model")
    rng = np.random.default_rng(0)
    write_corpus(root / "corpus", [rng.integers(0, VOCAB, rng.integers(20, 80)) for _ in range(200)])
    return {"root": root, "model": root / "model", "corpus": root / "corpus"}


def write_corpus(prefix: Path, documents: list[np.ndarray]) -> Path:
    writer = IndexedDatasetWriter(f"{prefix}_text_document", np.uint16)
    writer.add_documents(d.astype(np.uint16) for d in documents)
    writer.finalize()
    return prefix


def train_config(assets: dict[str, Path], out: Path, **overrides: Any) -> TrainConfig:
    base = {
        "model": str(assets["model"]),
        "out": str(out),
        "data": {"paths": [str(assets["corpus"])]},
        "steps": 3,
        "seq_length": 32,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "optim": {"lr": 1e-3},
    }
    return TrainConfig.model_validate(base | overrides)


# --- flows and what they report ------------------------------------------------------------------


@flow(name="test-convert-export-stages")
def round_trip_flow(convert: ConvertConfig, export: ExportConfig) -> list[dict[str, Any]]:
    converted = convert_task(convert, return_state=True)
    return [outcome(converted), outcome(export_task(export, return_state=True))]


@flow(name="test-train-stage")
def train_flow(config: TrainConfig, nproc: int) -> dict[str, Any]:
    return outcome(train_task(config, nproc=nproc, return_state=True))


def run_train_flow(config: TrainConfig, nproc: int) -> tuple[dict[str, Any], list[str]]:
    """The task's outcome and every line the flow run logged to the Prefect API."""
    state = train_flow(config, nproc, return_state=True)
    return state.result(), flow_run_logs(state.state_details.flow_run_id)


def step_losses(lines: list[str]) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(3)) for line in lines if (m := STEP_LINE.match(line))}


# --- convert and export ----------------------------------------------------------------------------


def test_convert_then_export_round_trip(prefect_env, assets, tmp_path):
    from safetensors.torch import load_file

    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    converted, exported = round_trip_flow(ConvertConfig(hf=assets["model"], out=ckpt), ExportConfig(ckpt=ckpt, out=hf))

    assert converted["name"] == exported["name"] == "Completed"
    for record, stage, path in ((converted["result"], "convert", ckpt), (exported["result"], "export", hf)):
        assert isinstance(record, StageArtifact) and record.stage == stage and Path(record.path) == path
        assert record.manifest == read_manifest(path) and record.manifest["stage"] == stage
    assert converted["result"].manifest["padded_vocab_size"] == 128
    assert exported["result"].manifest["step"] == 0 and exported["result"].manifest["kind"] == "model"

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in safetensors_files(directory) for k, v in load_file(f).items()}

    original, round_tripped = tensors(assets["model"]), tensors(hf)
    assert original.keys() == round_tripped.keys()
    assert all(torch.equal(original[k], round_tripped[k]) for k in original)
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == VOCAB

    for stage, record in (("convert", converted["result"]), ("export", exported["result"])):
        (run,) = mlflow_runs(prefect_env, stage)
        assert run.info.status == "FINISHED"
        files = record.manifest["files"]
        assert run.data.metrics["files"] == len(files) and run.data.metrics["bytes"] == sum(f["size"] for f in files)
        assert run.data.metrics["seconds"] > 0
    assert mlflow_runs(prefect_env, "convert")[0].data.params["hf"] == str(assets["model"])
    assert mlflow_runs(prefect_env, "convert")[0].data.metrics["padded_vocab_size"] == 128
    assert mlflow_runs(prefect_env, "export")[0].data.params["ckpt"] == str(ckpt)

    # Same inputs again: both served from cache.
    again = round_trip_flow(ConvertConfig(hf=assets["model"], out=ckpt), ExportConfig(ckpt=ckpt, out=hf))
    assert [o["name"] for o in again] == ["Cached", "Cached"]


# --- train -----------------------------------------------------------------------------------------


def test_train_cache_key_covers_model_and_data_files_not_the_checkpoints(assets, tmp_path):
    (files_policy,) = [p for p in train_task.cache_policy.policies if isinstance(p, InputFiles)]
    corpus = write_corpus(tmp_path / "corpus", [np.arange(50) % VOCAB])
    config = train_config(assets, tmp_path / "run", data={"paths": [str(corpus)]})

    def key() -> str:
        return files_policy.compute_key(None, {"config": config, "nproc": 1}, {})

    first = key()
    (tmp_path / "run" / "step_00000001").mkdir(parents=True)  # what the run writes
    (tmp_path / "run" / "latest").write_text("step_00000001\n")
    assert key() == first
    write_corpus(corpus, [np.arange(60) % VOCAB])  # the dataset rewritten in place, same prefix
    assert key() != first


@flow(name="test-train-progress")
def step_lines_flow(lines: list[str]) -> tuple[Any, list[str]]:
    from prefect.runtime import flow_run

    logged: list[str] = []
    on_line = progress_reporter(logged.append, Path("run"))
    for line in lines:
        on_line(line)
    return flow_run.id, logged


def test_train_progress_follows_the_workers_step_lines():
    lines = ["loading", *(f"step {s}/4 | loss 1.0" for s in range(1, 4))]
    flow_run_id, logged = step_lines_flow(lines)
    assert logged == lines
    (progress,) = flow_run_artifacts(flow_run_id, "progress")
    assert progress.data == 75.0 and progress.description == "training run"


@pytest.mark.slow
def test_train_task_streams_worker_lines_and_tracks_rank0_metrics(prefect_env, assets, tmp_path):
    config = train_config(assets, tmp_path / "run", steps=3)
    result, logs = run_train_flow(config, nproc=2)

    assert result["name"] == "Completed", result["message"]
    artifact = result["result"]
    assert artifact.stage == "train" and Path(artifact.path) == tmp_path / "run"
    meta = read_meta(tmp_path / "run" / "step_00000003")
    assert artifact.manifest == {"step_dir": "step_00000003", **meta.model_dump(mode="json")}
    assert meta.step == 3 and meta.consumed_samples == 12
    assert artifact.manifest["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 1, "ep": 1}

    # Each worker line is one Prefect log record, as printed (rank 0 prints the steps).
    losses = step_losses(logs)
    assert sorted(losses) == [1, 2, 3]
    assert sum(bool(STEP_LINE.match(line)) for line in logs) == 3
    assert any(line == f"saved checkpoint {tmp_path / 'run' / 'step_00000003'}" for line in logs)

    (run,) = mlflow_runs(prefect_env, "train")
    assert run.info.status == "FINISHED"
    assert run.data.params["nproc"] == "2" and run.data.params["steps"] == "3"
    assert run.data.params["data.paths"] == str([str(assets["corpus"])])
    loss = metric_history(prefect_env, run, "loss")
    assert loss.keys() == losses.keys() and all(abs(loss[s] - losses[s]) < 1e-6 for s in loss)
    for key in ("lr", "grad_norm", "tokens_per_s", "samples_per_s", "memory_gib"):
        assert metric_history(prefect_env, run, key).keys() == {1, 2, 3}, key
    assert metric_history(prefect_env, run, "lr")[1] > metric_history(prefect_env, run, "lr")[3]  # cosine decay
    assert run.data.metrics["seconds"] > 0

    rerun, _ = run_train_flow(config, nproc=2)
    assert rerun["name"] == "Cached" and rerun["result"] == artifact
    assert len(mlflow_runs(prefect_env, "train")) == 1


@pytest.mark.slow
def test_failing_worker_fails_the_task_with_its_error(prefect_env, assets, tmp_path):
    bad = write_corpus(tmp_path / "bad", [np.arange(VOCAB, VOCAB + 40) % 2**16 for _ in range(20)])
    config = train_config(assets, tmp_path / "run", data={"paths": [str(bad)]})
    result, logs = run_train_flow(config, nproc=1)

    assert result["failed"]
    assert "workers exited with code 1" in result["message"]
    error = rf"ValueError: .*bad_text_document sample \d+ .*outside the model vocabulary \(vocab_size {VOCAB}\)"
    assert re.search(error, result["message"])
    assert any("outside the model vocabulary" in line for line in logs)  # streamed before the failure
    assert not (tmp_path / "run" / "latest").exists()
    (run,) = mlflow_runs(prefect_env, "train")
    assert run.info.status == "FAILED"


@pytest.mark.slow
def test_train_command_logs_its_run_to_the_workspace_mlflow_store(assets, tmp_path):
    config = train_config(assets, tmp_path / "run", steps=3)
    path = tmp_path / "train.json"
    path.write_text(config.model_dump_json())
    workspace = tmp_path / "ws"
    # Neither a tracking URI nor an experiment from the environment: the workspace's store.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run([str(Path(sys.executable).parent / "llmflow"), "train", str(path), "--workspace", str(workspace)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = {int(m[1]): float(m[3]) for line in done.stdout.splitlines() if (m := STEP_LINE.match(line))}
    assert sorted(losses) == [1, 2, 3]

    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("llmflow-train")
    assert experiment.artifact_location == (workspace / "mlartifacts").as_uri()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "train" and run.data.tags["llmflow.stage"] == "train"
    assert run.data.params["steps"] == "3" and run.data.params["nproc"] == "1" and run.data.params["out"] == str(tmp_path / "run")
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert loss.keys() == losses.keys() and all(abs(loss[s] - losses[s]) < 1e-6 for s in loss)
    assert {m.step for m in client.get_metric_history(run.info.run_id, "grad_norm")} == {1, 2, 3}
