"""The pretrain flow: a model pretrained on raw text (from its weights, or from scratch with
its config), exported and scored.

download -> convert (or initialise) -> tokenize pretraining text -> pretrain -> export ->
MMLU. Like every
flow, each stage is cached on its inputs and training resumes from its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from llmflow.flows import stages
from llmflow.flows.checks import check_layout
from llmflow.flows.params import PretrainParams, flow_parameters
from llmflow.flows.summary import publish_summary
from llmflow.tasks.export import export_task
from llmflow.tasks.train import train_task
from llmflow.train.config import DataConfig
from llmflow.weights.export import ExportConfig

FLOW = "pretrain"


@flow(name=FLOW, log_prints=True)
@flow_parameters(PretrainParams)
def pretrain(params: PretrainParams) -> dict[str, Any]:
    """Train ``params.model`` further on ``params.data``; returns the score and the outputs."""
    with stages.open_flow_run(FLOW, params) as run:
        workspace, refresh, sources = run.workspace, run.refresh, run.sources
        model_dir = sources.model(params.model, params.revision)
        check_layout(model_dir, params.train, params.launch)
        texts = sources.pretraining_text(params.data, params.data_files)
        name = stages.slug(params.model)

        checkpoint = stages.run_convert(run, model_dir, name, params.init, params.train.seed)
        tokenized = stages.run_tokenize_pretrain(run, texts, model_dir, params.model, params.data, params.data_files,
                                                 params.text_key)
        inputs_tag = stages.settings_tag(params.train, params.seq_length, checkpoint.manifest.get("files"),
                                         tokenized.manifest.get("files"))
        run_name = f"pretrain-{name}-{run.version}-{inputs_tag}"
        trained = stages.run(train_task, params.train.train_config(
            Path(checkpoint.path), workspace / "runs" / run_name, DataConfig(kind="pretrain", paths=[tokenized.path]),
            seq_length=params.seq_length,
        ), nproc=params.train.nproc, nnodes=params.train.nnodes, launch=params.launch, refresh=refresh)
        exported = stages.run(export_task, ExportConfig(ckpt=Path(trained.path), out=workspace / "models" / run_name),
                              refresh=refresh)
        mmlu_data = sources.benchmark_data("mmlu", params.evaluation.data)
        scored = stages.run_eval(workspace, params.evaluation, exported.path, mmlu_data, run_name, refresh)
        result = {"mmlu": scored.manifest["accuracy"], "version": run.version, "checkpoint": trained.path,
                  "model": exported.path, "evaluation": scored.path, "mlflow_run": run.mlflow_run}
        publish_summary(FLOW, result, run.mlflow_run)
    return result
