"""Checks before launch: every problem of a training config is reported at once, one line
each, before any worker starts or the run directory is created; a run directory with
checkpoints resumes only with the settings its weights depend on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from forked_workers import train_forked

from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
from llmflow.train.config import TrainConfig
from llmflow.train.preflight import check_training
from llmflow.weights import latest_step_dir

WORKER_ENV = {"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"}


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    """The sample model (4 heads, 2 KV heads, FFN 352, vocab 832) and pretraining data
    tokenized with its tokenizer."""
    root = tmp_path_factory.mktemp("preflight")
    sample = sample_assets(instruct_rows=10, documents=20)
    model = sample / "model"
    tokenize_pretrain(PretrainTokenizeConfig(input=[sample / "pretrain" / "corpus.parquet"], tokenizer=model, out=root / "wiki", append_eod=True))
    return {"root": root, "model": model, "wiki": root / "wiki", "corpus": sample / "pretrain" / "corpus.parquet"}


def settings(assets, out: Path, **overrides) -> dict:
    return {
        "model": str(assets["model"]),
        "out": str(out),
        "data": {"paths": [str(assets["wiki"])]},
        "steps": 2,
        "seq_length": 32,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "optim": {"lr": 1e-3},
        **overrides,
    }


def config(assets, out: Path, **overrides) -> TrainConfig:
    return TrainConfig.model_validate(settings(assets, out, **overrides))


def refused(cfg: TrainConfig, nproc: int = 1, env: dict[str, str] | None = None) -> list[str]:
    """The problem lines check_training reports for ``cfg`` (it must refuse)."""
    with pytest.raises(ValueError) as caught:
        check_training(cfg, nproc, {**WORKER_ENV, **(env or {})})
    header, *lines = str(caught.value).splitlines()
    assert header.endswith("found before launch, nothing was started:"), str(caught.value)
    return [line.removeprefix("  - ") for line in lines]


def test_cli_reports_an_impossible_layout_before_launch(assets, tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(settings(assets, out)))
    proc = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "train", "--nproc", "3", str(path), "tp=3"],
        check=False, capture_output=True, text=True, env={**os.environ, **WORKER_ENV}, timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "llmflow train: 3 problems found before launch, nothing was started:",
        "  - model num_attention_heads=4 is not divisible by tp=3",
        "  - model num_key_value_heads=2 is not divisible by tp=3",
        "  - model intermediate_size=352 is not divisible by tp=3",
    ]
    assert not out.exists()


def test_batch_sizes_against_dp_and_every_problem_at_once(assets, tmp_path):
    out = tmp_path / "run"
    problems = refused(config(assets, out, micro_batch_size=4, global_batch_size=4, tp=2, data={"paths": [str(tmp_path / "none")]}), nproc=4)
    assert problems == [
        "global_batch_size 4 is not a multiple of micro_batch_size * dp = 4 * 2",
        f"data {tmp_path / 'none'}: no pretraining dataset ({tmp_path / 'none'}_text_document.bin does not exist)",
    ]
    assert not out.exists()


def test_a_sequence_or_heads_context_parallelism_cannot_split_are_refused(assets, tmp_path):
    out = tmp_path / "run"
    assert refused(config(assets, out, seq_length=33, cp=2), nproc=2) == [
        ("seq_length=33 is not divisible by cp=2: each rank holds seq_length/cp positions; "
        "use a seq_length that is a multiple of 2"),
    ]
    assert refused(config(assets, out, cp=4, tp=2), nproc=8) == [
        ("model num_attention_heads/tp = 4/2 = 2 is not divisible by cp=4: Ulysses gives each rank 1/cp of the "
        "attention heads; use a cp that divides them, or cp_algo=ring"),
    ]
    assert refused(config(assets, out, cp=2, tp=2), nproc=6) == ["nproc=6 is not a multiple of cp*tp = 2*2 = 4"]
    assert not out.exists()


def test_data_tokenized_for_a_larger_vocabulary_is_refused(assets, make_hf_model, tmp_path):
    _, small = make_hf_model("qwen2", vocab_size=160)  # the data's ids go up to the sample model's vocabulary
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    out = tmp_path / "run"
    assert refused(config(assets, out, model=str(small))) == [(
        f"data {assets['wiki']} was tokenized for a vocabulary of {vocab} ids (tokenizer {assets['model']}), but model "
        f"{small} has vocab_size 160; tokenize the data with the model's tokenizer"
    )]
    assert not out.exists()


def test_more_workers_than_devices_is_refused(assets, tmp_path):
    nproc = torch.cuda.device_count() + 1
    out = tmp_path / "run"
    assert refused(config(assets, out), nproc=nproc, env={"LLMFLOW_DEVICE": "cuda"}) == [
        f"nproc={nproc} but this machine has {nproc - 1} cuda device(s)"
    ]
    assert not out.exists()


@pytest.mark.slow
def test_run_directory_resumes_only_with_the_settings_its_weights_depend_on(assets, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    data = tmp_path / "wiki"
    for f in assets["root"].glob("wiki[._]*"):
        shutil.copy(f, tmp_path / f.name)
    out = tmp_path / "run"

    def cfg(**overrides) -> TrainConfig:
        return config(assets, out, **{"model": str(model), "data": {"paths": [str(data)]}, "seed": 5, **overrides})

    train_forked(cfg(), 1, env=WORKER_ENV, process_group=True)
    saved = (out / "train_config.json").read_text()

    def refusal(*changes: str, step: int = 2) -> list[str]:
        return [(
            f"run directory {out} holds checkpoints (step {step}) trained with other settings the weights depend on: "
            f"{'; '.join(changes)}. Resume with the run's settings, or choose another out"
        )]

    assert refused(cfg(seed=6, optim={"lr": 2e-3, "decay": "linear"})) == refusal(
        "optim.decay 'cosine' -> 'linear'", "optim.lr 0.001 -> 0.002", "seed 5 -> 6"
    )
    assert refused(cfg(lora={"rank": 4}))[0].startswith(refusal("lora None -> {'rank': 4")[0].split(". Resume")[0])
    assert refused(cfg(model=str(assets["model"]))) == refusal(f"model '{model}' -> '{assets['model'].resolve()}'")
    assert refused(cfg(seq_length=16, data={"paths": [str(assets["wiki"])]})) == refusal(
        f"data.paths {[str(data)]!r} -> {[str(assets['wiki'].resolve())]!r}", "seq_length 32 -> 16"
    )
    assert refused(cfg(steps=1)) == [
        f"steps=1 but run directory {out} already holds step 2: a run continues, it cannot go back (choose another out)"
    ]
    assert (out / "train_config.json").read_text() == saved  # a refused run records nothing

    # A continuation onto another layout, other micro-batches and more steps is allowed.
    check_training(cfg(steps=4, tp=2, micro_batch_size=1), 2, WORKER_ENV)
    train_forked(cfg(steps=3, micro_batch_size=1), 1, env=WORKER_ENV, process_group=True)
    assert latest_step_dir(out).name == "step_00000003"
    assert json.loads((out / "train_config.json").read_text())["steps"] == 3

    # The same paths with other content are other inputs: data tokenized again, a model with
    # other weights, a model with another shape.
    tokenize_pretrain(PretrainTokenizeConfig(input=[assets["corpus"]], tokenizer=model, out=data))
    assert refused(cfg(steps=4)) == refusal(f"data {data}: its content changed since the checkpoints were made", step=3)
    for f in assets["root"].glob("wiki[._]*"):
        shutil.copy(f, tmp_path / f.name)
    check_training(cfg(steps=4), 1, WORKER_ENV)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")
    assert refused(cfg(steps=4)) == refusal(f"model {model}: its content changed since the checkpoints were made", step=3)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 5}))
    assert refused(cfg(steps=4)) == refusal(
        f"model: the config.json of {model} is not the one the checkpoints were trained from", step=3
    )
