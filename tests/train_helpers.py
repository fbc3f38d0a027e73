"""What the training tests share: the sample model with its tokenized data, configs over it,
and launching a run and reading its losses from the step lines."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Mapping
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


def step_metrics(lines: list[str], keys: Iterable[str]) -> dict[int, dict[str, float]]:
    """The metrics ``keys`` (those a step line has) of every step line, by step."""
    wanted = set(keys)
    steps = {}
    for line in lines:
        if match := re.match(r"^step (\d+)/\d+ \| (.*)", line):
            fields = dict(field.split(" ", 1) for field in match[2].split(" | "))
            steps[int(match[1])] = {key: float(value) for key, value in fields.items() if key in wanted}
    return steps


def assert_same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]],
                tolerances: Mapping[str, float]) -> None:
    """Every metric of every step of ``got`` as in ``want``, within its tolerance."""
    assert got and set(got) <= set(want)
    for step, metrics in got.items():
        assert metrics.keys() == want[step].keys(), (step, metrics, want[step])
        for key, value in metrics.items():
            assert abs(value - want[step][key]) <= tolerances[key], (step, key, got, want)


def resume_from(out: Path, step: int) -> None:
    """Make ``out`` a run directory whose latest checkpoint is the one of ``step``."""
    for later in out.glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (out / "latest").write_text(f"step_{step:08d}\n")
