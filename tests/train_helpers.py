"""What the training tests share: the sample model with its tokenized data, configs over it,
and launching a run and reading its losses from the step lines."""

from __future__ import annotations

import re
from pathlib import Path

from forked_workers import train_forked

from llmflow.data.tokenize_instruction import InstructionTokenizeConfig, tokenize_instruction
from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
from llmflow.train.config import TrainConfig

STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss ([0-9.]+)")
TOLERANCE = 1e-5  # fp32 losses of different layouts


def training_assets(sample: Path, root: Path) -> dict[str, Path]:
    """The sample model in ``sample`` and its data tokenized into ``root``, for pretraining and
    (packed) finetuning."""
    model = sample / "model"
    tokenize_pretrain(PretrainTokenizeConfig(input=[sample / "pretrain" / "corpus.parquet"], tokenizer=model, out=root / "wiki", append_eod=True))
    tokenize_instruction(
        InstructionTokenizeConfig(
            input=[sample / "instruct" / "alpaca.jsonl"], tokenizer=model, out=root / "sft", format="alpaca", seq_length=128, pack=True
        )
    )
    return {"root": root, "model": model, "wiki": root / "wiki", "sft": root / "sft"}


def config(assets, out: Path, kind: str = "pretrain", **overrides) -> TrainConfig:
    base = {
        "model": str(assets["model"]),
        "out": str(out),
        "data": {"kind": kind, "paths": [str(assets["wiki" if kind == "pretrain" else "sft"])]},
        "steps": 10,
        "seq_length": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "log_interval": 1,
    }
    for key, value in overrides.items():
        base[key] = value
    return TrainConfig.model_validate(base)


def losses(lines: list[str]) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for line in lines if (m := STEP_LINE.match(line))}


def run(cfg: TrainConfig, nproc: int) -> dict[int, float]:
    """Train ``cfg`` on ``nproc`` gloo ranks forked with the training loop imported (the
    torchrun worker, started without torchrun's cost); its losses by step."""
    return losses(train_forked(cfg, nproc, env=SINGLE_THREAD))


def assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got and set(got) <= set(want)
    for step, loss in got.items():
        assert abs(loss - want[step]) <= TOLERANCE, (step, loss, want[step])


SINGLE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The environment of runs whose losses are compared bit for bit: one thread makes every
reduction's order the same from run to run, whatever the machine's load."""


def train_in_subprocess(cfg: TrainConfig) -> dict[int, float]:
    """Train ``cfg`` in one process without a process group, single-threaded; its losses by step."""
    return losses(train_forked(cfg, 1, env=SINGLE_THREAD))
