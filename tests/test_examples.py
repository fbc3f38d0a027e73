"""The example configs (examples/): every one loads, its layout, batch sizes and pipeline
settings pass the checks ``llmflow train --nproc 8`` makes, its memory plan with the model's
published config.json fits a 64 GB device, and examples/README.md's table is that plan's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmflow.mesh import ParallelLayout
from llmflow.models import ModelConfig
from llmflow.train.config import TrainConfig, load_train_config
from llmflow.train.memory import MemoryPlan, model_params, size, train_plan, train_shape
from llmflow.train.preflight import batch_problems, parallel_problems, pipeline_problems

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NPROC = 8
DEVICE_BYTES = 64 * 10**9
PUBLISHED_PARAMETERS = {  # the model cards' parameter counts
    "qwen1.5-0.5b": 463_987_712,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.1-8b": 8_030_261_248,
}
CONFIGS = sorted(EXAMPLES.glob("*/*.yaml"))


def seq_length(path: Path, config: TrainConfig) -> int:
    """Pretraining: the config's seq_length; sft: the --seq-length of the tokenize command
    the example's comment gives."""
    if config.seq_length is not None:
        return config.seq_length
    return int(re.search(r"--seq-length (\d+)", path.read_text())[1])


def plan(path: Path) -> tuple[TrainConfig, MemoryPlan]:
    config = load_train_config(path)
    model = ModelConfig.from_file(path.parent / "config.json")
    shape = train_shape(config, NPROC, seq_length(path, config), "npu")
    return config, train_plan(model, shape, DEVICE_BYTES, "64 GB", name=path.parent.name)


def layout(config: TrainConfig) -> str:
    parts = [f"{name}={value}" for name, value in (("tp", config.tp), ("pp", config.pp)) if value > 1]
    dp = ParallelLayout.of_world(NPROC, config.pp, config.tp, config.dp).dp
    return " x ".join(parts + ([f"dp={dp}"] if dp > 1 else []))


def table() -> list[str]:
    """examples/README.md's table, from the plans."""
    rows = ["| example | layout | micro batch x tokens | activation checkpointing | peak per device | at |",
            "|---|---|---|---|---|---|"]
    for path in CONFIGS:
        config, p = plan(path)
        tokens = seq_length(path, config)
        rows.append(f"| `{path.relative_to(EXAMPLES)}` | {layout(config)} | {config.micro_batch_size} x {tokens} | "
                    f"{config.activation_checkpointing} | {size(p.peak)} | {p.peak_moment} |")
    return rows


def test_every_model_has_its_three_examples_and_published_config():
    assert {p.parent.name for p in CONFIGS} == set(PUBLISHED_PARAMETERS)
    assert len(CONFIGS) == 3 * len(PUBLISHED_PARAMETERS)
    for name, count in PUBLISHED_PARAMETERS.items():
        assert model_params(ModelConfig.from_file(EXAMPLES / name / "config.json")) == count
        assert {p.stem for p in CONFIGS if p.parent.name == name} == {"pretrain", "finetune", "lora"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_passes_the_checks_and_fits_64_gb(path):
    config = load_train_config(path)
    model = ModelConfig.from_file(path.parent / "config.json")
    dp = ParallelLayout.of_world(NPROC, config.pp, config.tp, config.dp).dp
    assert parallel_problems(NPROC, config.tp, config.dp, model, config.pp) == []
    assert batch_problems(config.global_batch_size, config.micro_batch_size, dp) == []
    assert pipeline_problems(config, dp, model.num_hidden_layers) == []
    assert (config.lora is not None) == (path.stem == "lora")
    assert (config.data.kind == "pretrain") == (path.stem == "pretrain")
    _, p = plan(path)
    assert p.fits, p.table()
    text = path.read_text()
    assert f"llmflow train --nproc {NPROC} examples/{path.parent.name}/{path.name}" in text
    assert f"--tokenizer workspace/models/{path.parent.name}" in text and "llmflow convert" in text


def test_readme_table_is_the_plan():
    readme = (EXAMPLES / "README.md").read_text().splitlines()
    start = readme.index(table()[0])
    assert readme[start:start + len(CONFIGS) + 2] == table()
