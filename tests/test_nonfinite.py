"""Non-finite numbers stop the run, with the place named: convert and the model loader
refuse NaN/Inf weights (file and tensor), training stops at the first non-finite loss or
gradient norm (step and first parameter), a checkpoint holding NaN/Inf is never saved (the
previous one stays ``latest``), and a rerun after the cause is fixed resumes from it.

The training runs use a tiny model whose embedding row of one token is 3e38: finite, so
the loader accepts it, but any batch holding that token overflows the first layer and
every gradient turns NaN. A corpus with one document of that token is the poisoned batch;
the fix rewrites that document in place with ordinary tokens.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_train_tasks import HF_CONFIG as TASK_MODEL
from test_train_tasks import VOCAB, run_train_flow, step_losses

from llmflow.artifacts import write_json_atomic
from llmflow.cli import main as cli_main
from llmflow.data.indexed import IndexedDatasetWriter
from llmflow.launch import WorkerError
from llmflow.models import CausalLM, ModelConfig
from llmflow.train.command import launch_training
from llmflow.train.config import TrainConfig
from llmflow.train.data import PretrainSamples
from llmflow.train.loop import train
from llmflow.weights import (
    CheckpointError,
    CheckpointMeta,
    NonFiniteError,
    load_hf_model,
    load_model,
    save_checkpoint,
    save_hf_model,
)
from llmflow.weights.dcp import dcp_save
from llmflow.weights.safetensors_io import read_safetensors_header
from llmflow.weights.training_checkpoint import LATEST, META, step_name

HF_CONFIG = {**TASK_MODEL, "tie_word_embeddings": False}
POISON = VOCAB - 1
SEED = 4  # the data order that first feeds the poisoned document at step 4
WORKER_ENV = {"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"}


def tiny_model(poisoned: bool = False) -> CausalLM:
    model = CausalLM(ModelConfig.from_hf(HF_CONFIG))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    if poisoned:
        with torch.no_grad():
            model.model.embed_tokens.weight[POISON] = 3e38
    return model


@pytest.fixture(scope="module")
def poisoned_model(tmp_path_factory) -> Path:
    return save_hf_model(tiny_model(poisoned=True), tmp_path_factory.mktemp("nonfinite") / "model")


def write_corpus(prefix: Path, poisoned: bool) -> Path:
    """Ten documents of ordinary tokens and one of the poison token (ordinary when not
    ``poisoned``: the same lengths, so the same samples)."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, POISON, 40) for _ in range(10)]
    documents.append(np.full(40, POISON) if poisoned else rng.integers(0, POISON, 40))
    writer = IndexedDatasetWriter(f"{prefix}_text_document", np.uint16)
    writer.add_documents(d.astype(np.uint16) for d in documents)
    writer.finalize()
    return prefix


def train_config(model: Path, corpus: Path, out: Path, **overrides: Any) -> TrainConfig:
    base = {
        "model": str(model),
        "out": str(out),
        "data": {"paths": [str(corpus)]},
        "steps": 8,
        "seq_length": 16,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "optim": {"lr": 1e-3},
        "save_interval": 2,
        "seed": SEED,
        "log_interval": 1,
    }
    return TrainConfig.model_validate(base | overrides)


def first_poisoned_step(config: TrainConfig) -> int:
    samples = PretrainSamples(config.data.paths[0], config.seq_length, config.seed)
    first = next(g for g in range(samples.num_samples) if POISON in samples[g].input_ids.tolist())
    return first // config.global_batch_size + 1


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".step_")))


def overwrite(path: Path, tensor: str, index: int, value: float) -> None:
    """Overwrite float32 element ``index`` of ``tensor`` in a safetensors file, in place."""
    stored = read_safetensors_header(path)[tensor]
    with open(path, "r+b") as f:
        f.seek(stored.offset + 4 * index)
        f.write(struct.pack("<f", value))


# --- weights in --------------------------------------------------------------------------------------


def test_convert_refuses_a_nan_weight_naming_file_and_tensor(tmp_path):
    hf = save_hf_model(tiny_model(), tmp_path / "hf")
    weights = hf / "model.safetensors"
    overwrite(weights, "model.layers.1.mlp.down_proj.weight", 7, float("nan"))
    out = tmp_path / "ckpt"

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "--hf", str(hf), "--out", str(out)])
    assert exit_info.value.code == (
        f"llmflow convert: {weights}: tensor 'model.layers.1.mlp.down_proj.weight' holds non-finite numbers "
        "(1 NaN and 0 Inf values of 2048); the file is damaged or the model diverged"
    )
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]  # nothing half-written


def test_model_loader_refuses_non_finite_weights(tmp_path):
    hf = save_hf_model(tiny_model(), tmp_path / "hf")
    weights = hf / "model.safetensors"
    overwrite(weights, "model.norm.weight", 3, float("-inf"))
    message = rf"^{weights}: tensor 'model.norm.weight' holds non-finite numbers \(0 NaN and 1 Inf values of 32\)"
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(hf)
    with pytest.raises(CheckpointError, match=message):
        load_model(hf)

    # A checkpoint step directory (DCP) holding a NaN, as another tool could have written it.
    model = tiny_model()
    state = model.state_dict()
    state["model.layers.0.self_attn.k_proj.bias"][5] = float("nan")
    step_dir = tmp_path / "ckpt" / step_name(0)
    dcp_save({"model": state}, step_dir)
    write_json_atomic(step_dir / META, CheckpointMeta(hf_config=HF_CONFIG, padded_vocab_size=VOCAB).model_dump(mode="json"))
    (tmp_path / "ckpt" / LATEST).write_text(step_dir.name + "\n")
    with pytest.raises(CheckpointError, match=rf"^{step_dir}: tensor 'model.model.layers.0.self_attn.k_proj.bias' holds non-finite numbers \(1 NaN"):
        load_model(tmp_path / "ckpt")


# --- checkpoints out ---------------------------------------------------------------------------------


def test_checkpoint_save_refuses_non_finite_state_and_latest_stays(tmp_path):
    model = tiny_model()
    meta = CheckpointMeta(hf_config=HF_CONFIG, padded_vocab_size=VOCAB)
    save_checkpoint(tmp_path, 1, {"model": model.state_dict()}, meta)

    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad["lm_head.weight"][3, 4] = float("inf")
    with pytest.raises(NonFiniteError, match=rf"^refusing to save step 2: model.lm_head.weight holds NaN or Inf; {tmp_path / LATEST} still names step_00000001, where a rerun resumes$"):
        save_checkpoint(tmp_path, 2, {"model": bad}, meta)
    optimizer = {"state": {"model.norm.weight": {"step": torch.tensor(2.0), "exp_avg": torch.full((32,), float("nan"))}}}
    with pytest.raises(NonFiniteError, match=r"^refusing to save step 2: optimizer.state.model.norm.weight.exp_avg holds NaN or Inf"):
        save_checkpoint(tmp_path, 2, {"model": model.state_dict(), "optimizer": optimizer}, meta)
    assert (tmp_path / LATEST).read_text() == "step_00000001\n"
    assert step_dirs(tmp_path) == ["step_00000001"]


# --- training (in this process) ------------------------------------------------------------------------


def test_training_stops_at_the_first_non_finite_step_naming_the_parameter(poisoned_model, tmp_path):
    config = train_config(poisoned_model, write_corpus(tmp_path / "corpus", poisoned=True), tmp_path / "run")
    bad = first_poisoned_step(config)
    assert bad == 4  # SEED's data order: checkpoint step 2 is saved before it, step 4 would be saved after

    with pytest.raises(NonFiniteError, match=(
        rf"^step {bad}: loss [0-9.]+, grad_norm nan \(first non-finite gradient: model.embed_tokens.weight\); "
        rf"training stopped, {tmp_path / 'run' / LATEST} still names step_00000002, where a rerun resumes$"
    )):
        train(config)
    assert (tmp_path / "run" / LATEST).read_text() == "step_00000002\n"
    assert step_dirs(tmp_path / "run") == ["step_00000002"]


def test_a_learning_rate_that_overflows_stops_at_the_first_non_finite_loss(poisoned_model, tmp_path):
    # Step 1's update moves every weight by about the learning rate: step 2's forward overflows.
    config = train_config(poisoned_model, write_corpus(tmp_path / "corpus", poisoned=False), tmp_path / "run",
                          optim={"lr": 1e37}, save_interval=1)
    with pytest.raises(NonFiniteError, match=(
        rf"^step 2: loss (nan|inf), grad_norm (nan|inf) .*; training stopped, {tmp_path / 'run' / LATEST} still names step_00000001"
    )):
        train(config)
    assert step_dirs(tmp_path / "run") == ["step_00000001"]


# --- torchrun workers ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_train_reports_the_non_finite_step_in_one_line(poisoned_model, tmp_path):
    config = train_config(poisoned_model, write_corpus(tmp_path / "corpus", poisoned=True), tmp_path / "run")
    path = tmp_path / "train.json"
    path.write_text(config.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "train", str(path), "--nproc", "1", "--workspace", str(tmp_path)],
        check=False, capture_output=True, text=True, env={**os.environ, **WORKER_ENV},
    )
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"llmflow train {path}: workers exited with code 1; last output: NonFiniteError: step 4: loss ")
    assert line.endswith(
        "(first non-finite gradient: model.embed_tokens.weight); training stopped, "
        f"{tmp_path / 'run' / LATEST} still names step_00000002, where a rerun resumes"
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"cp": 2}], ids=["tp2", "pp2", "cp2"])
def test_parallel_ranks_agree_on_the_first_non_finite_gradient(poisoned_model, tmp_path, layout):
    config = train_config(poisoned_model, write_corpus(tmp_path / "corpus", poisoned=True), tmp_path / "run", **layout)
    with pytest.raises(WorkerError) as error:
        launch_training(config, 2, on_line=lambda line: None, env=WORKER_ENV)
    # One line, from rank 0, naming what both ranks found (tp: DTensor gradients, local shards;
    # pp: each stage its own parameters, the first in the whole model's order; cp: the poisoned
    # token in one rank's half of its sequence, the loss and gradients summed over both).
    assert str(error.value).startswith("workers exited with code 1; last output: NonFiniteError: step 4: loss ")
    assert "\n" not in str(error.value)
    assert "(first non-finite gradient: model.embed_tokens.weight)" in str(error.value)
    assert (tmp_path / "run" / LATEST).read_text() == "step_00000002\n"
    assert step_dirs(tmp_path / "run") == ["step_00000002"]


@pytest.mark.slow
def test_train_stage_fails_with_the_message_and_the_retry_after_the_fix_resumes(prefect_env, poisoned_model, tmp_path, monkeypatch):
    from prefect_helpers import mlflow_runs
    for key, value in WORKER_ENV.items():
        monkeypatch.setenv(key, value)
    corpus = write_corpus(tmp_path / "corpus", poisoned=True)
    config = train_config(poisoned_model, corpus, tmp_path / "run")
    result, logs = run_train_flow(config, nproc=1)

    assert result["failed"]
    assert re.search(
        r"workers exited with code 1; last output: NonFiniteError: step 4: loss [0-9.]+, grad_norm nan "
        r"\(first non-finite gradient: model.embed_tokens.weight\); training stopped, .* still names step_00000002",
        result["message"],
    ), result["message"]
    assert sorted(step_losses(logs)) == [1, 2, 3]
    assert (tmp_path / "run" / LATEST).read_text() == "step_00000002\n"

    write_corpus(corpus, poisoned=False)  # the poisoned document replaced, same path, same config
    result, logs = run_train_flow(config, nproc=1)
    assert result["name"] == "Completed", result["message"]
    assert any(line.startswith(f"resumed from {tmp_path / 'run' / 'step_00000002'} at step 2") for line in logs)
    assert sorted(step_losses(logs)) == list(range(3, 9))
    assert result["result"].manifest["step"] == 8
    assert [run.info.status for run in mlflow_runs(prefect_env, "train")] == ["FAILED", "FINISHED"]
