"""The finetune-and-eval flow: a base model finetuned on instruction data, exported, tried
on prompts, and scored before and after on a list of benchmarks (MMLU by default); the
result registered in MLflow when the gate benchmark's score passes the gate (by default: no
worse than the base model's).

Run it from the Prefect UI (deployment ``finetune-eval``), nightly on a schedule, or with
``llmflow demo``. Every stage is cached on its inputs: a retried run skips what finished,
and training resumes from its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import deployment

from llmflow import tracking
from llmflow.data.tokenize_instruction import InstructionTokenizeConfig
from llmflow.flows import stages
from llmflow.flows.checks import check_layout
from llmflow.flows.comparison import (
    REGRESSION_TAG,
    ComparisonRow,
    compare,
    comparison_table,
    previous_run_metrics,
    registered_scores,
    regression_tag,
)
from llmflow.flows.params import FinetuneEvalParams, flow_parameters
from llmflow.flows.summary import BENCHMARK_TITLES, publish_summary
from llmflow.infer.batch import InferConfig
from llmflow.tasks.export import export_task
from llmflow.tasks.infer import infer_task
from llmflow.tasks.register import register_model_task, registry_gate
from llmflow.tasks.tokenize import tokenize_instruction_task
from llmflow.tasks.train import train_task
from llmflow.train.config import DataConfig
from llmflow.weights.export import ExportConfig

FLOW = "finetune-eval"


@flow(name=FLOW, log_prints=True)
@flow_parameters(FinetuneEvalParams)
def finetune_eval(params: FinetuneEvalParams) -> dict[str, Any]:
    """download -> convert -> tokenize -> benchmarks of the base model -> finetune -> export ->
    answers to the prompts -> benchmarks of the finetuned model -> register, when the gate
    benchmark's scores pass the gate; returns the scores, the gate's verdict and where the
    outputs are."""
    with stages.open_flow_run(FLOW, params) as run:
        workspace, refresh, sources = run.workspace, run.refresh, run.sources
        megatron = stages.megatron_checkpoint(params.model)
        # A Megatron checkpoint's config and tokenizer come from megatron_hf's Hugging Face model.
        model_dir = sources.model(params.megatron_hf if megatron else params.model, params.revision)
        check_layout(model_dir, params.train, params.launch)
        data = sources.instruction_data(params.data, params.data_files)
        name = stages.slug(params.model)

        checkpoint = stages.run_convert(run, model_dir, name, megatron=megatron)
        base_model = Path(checkpoint.path) if megatron else model_dir
        data_tag = stages.settings_tag(params.data_files, params.data_format, params.map_keys, params.template,
                                       params.seq_length, params.pack)
        tokenized = stages.run(tokenize_instruction_task, InstructionTokenizeConfig(
            input=data, tokenizer=model_dir, format=params.data_format, map_keys=params.map_keys,
            template=params.template, seq_length=params.seq_length, pack=params.pack,
            out=workspace / "data" / name / f"{stages.slug(params.data)}-{data_tag}",
        ), refresh=refresh)
        # Scored before training: an unchanged base model's scores come from cache.
        before = stages.run_benchmarks(run, params.evaluation, params.benchmark_data, params.benchmarks, base_model,
                                       f"base-{name}")
        # The run directory is named by everything the weights depend on: a changed input gets
        # a fresh run instead of "resuming" a finished one.
        inputs_tag = stages.settings_tag(params.train, checkpoint.manifest.get("files"), tokenized.manifest.get("files"))
        run_name = f"{name}-{run.version}-{inputs_tag}"
        trained = stages.run(train_task, params.train.train_config(
            Path(checkpoint.path), workspace / "runs" / run_name, DataConfig(kind="sft", paths=[tokenized.path]),
        ), nproc=params.train.nproc, nnodes=params.train.nnodes, launch=params.launch, refresh=refresh)
        exported = stages.run(export_task, ExportConfig(
            ckpt=Path(trained.path), out=workspace / "models" / run_name, merge_lora=params.train.lora is not None,
        ), refresh=refresh)
        megatron_export = None
        if params.megatron_export:
            target = params.megatron_export
            megatron_export = stages.run(export_task, ExportConfig(
                ckpt=Path(trained.path), megatron=workspace / "models" / f"{run_name}-megatron-{target.megatron_format}"
                f"-tp{target.tp}-pp{target.pp}-ep{target.ep}", tp=target.tp, pp=target.pp, ep=target.ep,
                megatron_format=target.megatron_format,
                merge_lora=params.train.lora is not None,
            ), refresh=refresh).path
        answers = None
        if params.prompts:
            answers = stages.run(infer_task, InferConfig(
                model=Path(exported.path), prompts=stages.write_prompts(workspace, params.prompts),
                out=workspace / "generations" / run_name, template=params.template or "tokenizer",
                max_new_tokens=params.max_new_tokens,
            ), refresh=refresh).path
        after = stages.run_benchmarks(run, params.evaluation, params.benchmark_data, params.benchmarks,
                                      exported.path, run_name)
        scores = {f"{b}_{when}{key}": scored[b].manifest[f"accuracy{key}"] for b in params.benchmarks
                  for when, scored in (("before", before), ("after", after)) for key in ("", "_stderr")
                  if scored[b].manifest.get(f"accuracy{key}") is not None}
        tracking.log_metrics(run.mlflow_run, scores)
        rows = compare(params.benchmarks, scores, previous_run_metrics(FLOW, deployment.name or "", run.mlflow_run),
                       registered_scores(params.registered_model) if params.registered_model else {})
        publish_comparison(run.mlflow_run, rows)
        registered = gate = None
        if params.registered_model:
            gated = params.gate_benchmark
            gate = registry_gate(scores[f"{gated}_before"], scores[f"{gated}_after"], params.register_min_gain,
                                 BENCHMARK_TITLES[gated])
            tracking.set_tags(run.mlflow_run, gate.tags())
            print(f"registry gate: {gate.reason}")
            if gate.passed:
                registered = stages.run(register_model_task, params.registered_model, exported, scores,
                                        refresh=refresh)
        result = {
            **{key: value for key, value in scores.items() if not key.endswith("_stderr")},
            "comparison": comparison_table(rows),
            "version": run.version,
            "checkpoint": trained.path,
            "model": exported.path,
            "megatron_model": megatron_export,
            "answers": answers,
            "registered": registered,
            "gate": gate.model_dump() if gate else None,
            "mlflow_run": run.mlflow_run,
        }
        publish_summary(FLOW, result, run.mlflow_run)
    return result


def publish_comparison(mlflow_run: str, rows: list[ComparisonRow]) -> None:
    """The comparison as a Prefect table artifact, an MLflow table and the regression tag."""
    from mlflow import MlflowClient

    table = comparison_table(rows)
    tag = regression_tag(rows)
    create_table_artifact(key=f"{FLOW}-comparison", table=table,
                          description=f"Scores against the last registered model and the previous run; regression: {tag}")
    MlflowClient().log_table(mlflow_run, {key: [row[key] for row in table] for key in table[0]}, "comparison.json")
    tracking.set_tags(mlflow_run, {REGRESSION_TAG: tag})
