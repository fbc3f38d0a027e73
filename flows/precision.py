"""The precision flow: the same few training steps in two configurations (tp=2, cp=2 or pp=2
against one process, bf16 against fp32, one device against the CPU, one checkpoint against
another), both dumped in msprobe's format in deterministic mode, then compared (runs of
different layouts whole: tensor-parallel and context-parallel shards and pipeline stages
merged); the advisor's verdict and the worst rows go to MLflow and to Prefect artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from llmflow.artifacts import write_json_atomic
from llmflow.flows import stages
from llmflow.flows.params import PrecisionParams, RunSide, flow_parameters
from llmflow.probe.compare.tables import CROSS_LAYOUT_NOISE_FLOOR, CompareConfig
from llmflow.probe.dump.config import ProbeConfig
from llmflow.tasks.probe import compare_task
from llmflow.tasks.train import train_task
from llmflow.train.config import DataConfig, OptimConfig, TrainConfig

FLOW = "precision"


def dump_run(run: stages.FlowRun, params: PrecisionParams, side: RunSide, label: str, data: str) -> Path:
    """Convert ``side``'s model, train ``params.steps`` deterministic steps with the probe on;
    returns the dump's step folder of the first dumped step."""
    model_dir = run.sources.model(side.model)
    checkpoint = stages.run_convert(run, model_dir, stages.slug(side.model))
    folder = run.workspace / "precision" / f"{label}-{stages.settings_tag(side, params, checkpoint.manifest.get('files'))}"
    probe = ProbeConfig(task=params.task, dump_path=folder / "dump", step=params.dump_steps, level=params.level)
    probe_file = write_json_atomic(folder / "probe.json", probe.model_dump(mode="json", by_alias=True, exclude_none=True))
    config = TrainConfig(
        model=Path(checkpoint.path), out=folder / "run", data=DataConfig(kind="pretrain", paths=[data]),
        steps=params.steps, seq_length=params.seq_length, micro_batch_size=params.batch_size // params.micro_batches,
        global_batch_size=params.batch_size, optim=OptimConfig(lr=1e-4, decay="constant"), tp=side.tp, cp=side.cp,
        pp=side.pp, dtype=side.dtype, deterministic=True, probe=str(probe_file), save_interval=None,
    )
    device = None if side.device == "auto" else side.device
    stages.run(train_task, config, nproc=side.pp * side.cp * side.tp, device=device, refresh=run.refresh)
    return folder / "dump" / f"step{min(params.dump_steps)}"


@flow(name=FLOW, log_prints=True)
@flow_parameters(PrecisionParams)
def precision(params: PrecisionParams) -> dict[str, Any]:
    """Dump both runs, compare the target against the bench; returns the advisor's text,
    row counts and where the comparison is."""
    with stages.open_flow_run(FLOW, params) as run:
        texts = run.sources.pretraining_text(params.data, params.data_files)
        tokenizer = run.sources.model(params.bench.model)
        tokenized = stages.run_tokenize_pretrain(run, texts, tokenizer, params.bench.model, params.data, params.data_files)
        target = dump_run(run, params, params.target, "target", tokenized.path)
        bench = dump_run(run, params, params.bench, "bench", tokenized.path)
        out = run.workspace / "precision" / f"compare-{stages.settings_tag(str(target), str(bench))}"
        layouts = {(side.tp, side.cp, side.pp) for side in (params.target, params.bench)}
        noise_floor = CROSS_LAYOUT_NOISE_FLOOR if len(layouts) > 1 else 0.0  # float32 rounding
        compared = stages.run(compare_task, CompareConfig(target=target, bench=bench, out=out, norm_noise_floor=noise_floor),
                              refresh=run.refresh)
        advice = (Path(compared.path) / "advisor.txt").read_text(encoding="utf-8")
        result = {"advice": advice, "comparison": compared.path, "mlflow_run": run.mlflow_run}
    return result
