"""The finetune-and-eval flow: a base model finetuned on instruction data, exported, tried
on prompts, and every stage's model scored on a list of benchmarks (MMLU by default); the
result registered in MLflow when the gate benchmark's score passes the gate (by default: no
worse than the model its last stage started from).

With ``method`` dpo, simpo or orpo the finetuned (SFT) model is then aligned on preference
pairs (DPO's reference log-probs computed by a stage of their own), its implicit reward's
accuracy on held-out pairs measured before and after alignment, and the aligned model is the
one answered with and registered; the base, SFT and aligned models' scores are compared side
by side, and the gate holds the aligned model to the SFT model's (``gate_against``). With
``method`` grpo the SFT model is instead reinforced on a prompt set with GRPO, and the reward
accuracy of its greedy completions of held-out prompts is measured before and after.

Run it from the Prefect UI (deployment ``finetune-eval``), nightly on a schedule, or with
``llmflow demo``. Every stage is cached on its inputs: a retried run skips what finished,
and training resumes from its last checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import deployment

from llmflow import tracking
from llmflow.data.tokenize_instruction import InstructionTokenizeConfig
from llmflow.data.tokenize_preference import PreferenceTokenizeConfig
from llmflow.evaluate.rl_rewards import HeldoutRewardsConfig
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
from llmflow.tasks.common import StageArtifact
from llmflow.tasks.evaluate import heldout_rewards_task
from llmflow.tasks.export import export_task
from llmflow.tasks.infer import infer_task
from llmflow.tasks.register import RegistryGate, register_model_task, registry_gate
from llmflow.tasks.tokenize import tokenize_instruction_task, tokenize_preference_task
from llmflow.tasks.train import pair_logps_task, train_task
from llmflow.train.config import DataConfig, OptimConfig
from llmflow.train.reference import LOGPS, reward_accuracy
from llmflow.weights.export import ExportConfig

FLOW = "finetune-eval"
GATE_MODELS = {"before": "base", "sft": "SFT"}
"""The gate's reference models, by their scores' suffix, as its reason names them."""


@flow(name=FLOW, log_prints=True)
@flow_parameters(FinetuneEvalParams)
def finetune_eval(params: FinetuneEvalParams) -> dict[str, Any]:
    """download -> convert -> tokenize -> benchmarks of the base model -> finetune -> export ->
    benchmarks of the finetuned (SFT) model -> (method dpo, simpo or orpo: tokenize the
    preference pairs -> the reference log-probs (dpo) -> align -> export -> the held-out pairs'
    log-probs before and after; method grpo: the held-out prompts' rewards -> GRPO -> export ->
    the held-out prompts' rewards after; then the benchmarks of the aligned model) -> answers to the prompts ->
    register, when the gate benchmark's scores pass the gate; returns the scores, the gate's
    verdict and where the outputs are."""
    with stages.open_flow_run(FLOW, params) as run:
        workspace, refresh, sources = run.workspace, run.refresh, run.sources
        megatron = stages.megatron_checkpoint(params.model)
        # A Megatron checkpoint's config and tokenizer come from megatron_hf's Hugging Face model.
        model_dir = sources.model(params.megatron_hf if megatron else params.model, params.revision)
        check_layout(model_dir, params.train, params.launch)
        data = sources.instruction_data(params.data, params.data_files)
        aligner = ALIGNMENTS[params.method](run, params, model_dir) if params.method != "sft" else None
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
        benchmarks = functools.partial(stages.run_benchmarks, run, params.evaluation, params.benchmark_data,
                                       params.benchmarks)
        # Scored before training: an unchanged base model's scores come from cache.
        before = benchmarks(base_model, f"base-{name}")
        # The run directory is named by everything the weights depend on: a changed input gets
        # a fresh run instead of "resuming" a finished one.
        inputs_tag = stages.settings_tag(params.train, checkpoint.manifest.get("files"), tokenized.manifest.get("files"))
        run_name = f"{name}-{run.version}-{inputs_tag}"
        trained = stages.run(train_task, params.train.train_config(
            Path(checkpoint.path), workspace / "runs" / run_name, DataConfig(kind="sft", paths=[tokenized.path]),
        ), nproc=params.train.nproc, nnodes=params.train.nnodes, launch=params.launch, refresh=refresh)
        lora = params.train.lora is not None
        exported = stages.run(export_task, ExportConfig(
            ckpt=Path(trained.path), out=workspace / "models" / run_name, merge_lora=lora,
        ), refresh=refresh)
        finetuned = benchmarks(exported.path, run_name)
        scored = {"before": before, "after": finetuned}
        alignment = None
        if aligner:
            alignment = aligner(exported, run_name)
            trained, exported, run_name, lora = alignment.trained, alignment.exported, alignment.run_name, alignment.lora
            tracking.log_metrics(run.mlflow_run, alignment.rewards)
            scored = {"before": before, "sft": finetuned, "after": benchmarks(exported.path, run_name)}
        megatron_export = None
        if params.megatron_export:
            target = params.megatron_export
            megatron_export = stages.run(export_task, ExportConfig(
                ckpt=Path(trained.path), megatron=workspace / "models" / f"{run_name}-megatron-{target.megatron_format}"
                f"-tp{target.tp}-pp{target.pp}-ep{target.ep}", tp=target.tp, pp=target.pp, ep=target.ep,
                megatron_format=target.megatron_format,
                merge_lora=lora,
            ), refresh=refresh).path
        answers = None
        if params.prompts:
            answers = stages.run(infer_task, InferConfig(
                model=Path(exported.path), prompts=stages.write_prompts(workspace, params.prompts),
                out=workspace / "generations" / run_name, template=params.template or "tokenizer",
                max_new_tokens=params.max_new_tokens,
            ), refresh=refresh).path
        scores = stage_scores(params.benchmarks, scored)
        tracking.log_metrics(run.mlflow_run, scores)
        rows = compare(params.benchmarks, scores, previous_run_metrics(FLOW, deployment.name or "", run.mlflow_run),
                       registered_scores(params.registered_model) if params.registered_model else {})
        publish_comparison(run.mlflow_run, rows)
        registered = gate = None
        if params.registered_model:
            gate = registry_verdict(params, scores)
            tracking.set_tags(run.mlflow_run, gate.tags())
            print(f"registry gate: {gate.reason}")
            if gate.passed:
                registered = stages.run(register_model_task, params.registered_model, exported,
                                        {**scores, **(alignment.rewards if alignment else {})}, refresh=refresh)
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
            **(alignment.result() if alignment else {}),
        }
        publish_summary(FLOW, result, run.mlflow_run)
    return result


def stage_scores(benchmarks: list[str], scored: dict[str, dict[str, StageArtifact]]) -> dict[str, float]:
    """``{benchmark}_{stage}`` and ``{benchmark}_{stage}_stderr`` of each stage's evaluation
    stages (``scored``: by stage (before, sft, after), the artifacts by benchmark)."""
    return {f"{b}_{stage}{key}": artifacts[b].manifest[f"accuracy{key}"] for b in benchmarks
            for stage, artifacts in scored.items() for key in ("", "_stderr")
            if artifacts[b].manifest.get(f"accuracy{key}") is not None}


def registry_verdict(params: FinetuneEvalParams, scores: dict[str, float]) -> RegistryGate:
    """The registry gate of the final model's ``params.gate_benchmark`` score (``scores`` as
    ``stage_scores`` gives them): held against the SFT model's when an alignment stage followed
    it and ``params.gate_against`` is previous, else against the base model's; with an
    alignment stage the reason names both models."""
    benchmark = params.gate_benchmark
    aligned = f"{benchmark}_sft" in scores
    against = "sft" if aligned and params.gate_against == "previous" else "before"
    return registry_gate(scores[f"{benchmark}_{against}"], scores[f"{benchmark}_after"], params.register_min_gain,
                         BENCHMARK_TITLES[benchmark], (GATE_MODELS[against], params.method) if aligned else None)


@dataclass
class Alignment:
    """What an alignment method's stages left, whatever the method: the aligned run and its
    export (the flow's final model from then on), the SFT model it started from, the held-out
    scores before and after alignment, and the method's own outputs."""

    method: str
    trained: StageArtifact
    exported: StageArtifact
    run_name: str
    lora: bool
    """The aligned run trained a LoRA adapter (its exports merge it)."""
    sft: StageArtifact
    rewards: dict[str, float]
    """Held-out scores, logged to MLflow, tagged on the registered version and returned (the
    preference alignment's: reward_accuracy_before/_after, reward_margin_before/_after and heldout_pairs)."""
    outputs: dict[str, str | None]
    """The method's own outputs in the flow result (the preference alignment's: reference, the
    dpo reference log-probs' directory)."""

    def result(self) -> dict[str, Any]:
        """The flow result's entries of the alignment."""
        return {**self.rewards, "method": self.method, "sft_model": self.sft.path, **self.outputs}


Aligner = Callable[[StageArtifact, str], Alignment]
"""An alignment method's stages, ready to run on the SFT model's export (and its run's name)."""


def preference_alignment(run: stages.FlowRun, params: FinetuneEvalParams, model_dir: Path) -> Aligner:
    """The preference alignment (method dpo, simpo or orpo): its layout checked against the
    model ``model_dir`` and the pairs' sources found (downloaded) now, before any heavy stage;
    its stages (``align_on_pairs``) left to the function returned."""
    preference = params.preference
    check_layout(model_dir, preference.train, params.launch)  # type: ignore[arg-type]
    pairs = {"train": run.sources.preference_data(preference.data, preference.data_files, "train"),
             "heldout": run.sources.preference_data(preference.heldout_data, preference.heldout_data_files,
                                                    "heldout")}
    return functools.partial(align_on_pairs, run, params, pairs, model_dir)


def rl_alignment(run: stages.FlowRun, params: FinetuneEvalParams, model_dir: Path) -> Aligner:
    """The online RL alignment (method grpo): its layout checked against the model
    ``model_dir`` and the prompt files found (downloaded) now, before any heavy stage; its
    stages (``reinforce``) left to the function returned."""
    rl = params.rl
    check_layout(model_dir, rl.train, params.launch)  # type: ignore[arg-type]
    prompts = {"train": run.sources.prompt_file(rl.data, rl.data_files, "train"),
               "heldout": run.sources.prompt_file(rl.heldout_data, rl.heldout_data_files, "heldout")}
    return functools.partial(reinforce, run, params, prompts)


ALIGNMENTS: dict[str, Callable[[stages.FlowRun, FinetuneEvalParams, Path], Aligner]] = {
    **dict.fromkeys(("dpo", "simpo", "orpo"), preference_alignment), "grpo": rl_alignment}
"""Each alignment method, by ``method``: called with the flow run, its parameters and the base
model's directory before any heavy stage (its checks, its sources), it returns its stages."""


def align_on_pairs(run: stages.FlowRun, params: FinetuneEvalParams, pairs: dict[str, list[Path]], tokenizer: Path,
                   sft: StageArtifact, sft_name: str) -> Alignment:
    """The preference alignment's stages after the SFT model's export ``sft`` (its run named
    ``sft_name``): the preference pairs' files (``pairs``: train and heldout) tokenized with
    ``tokenizer`` and the flow's template, (dpo) the SFT model's log-probs of the training
    pairs as the reference, the ``params.method`` run from the SFT model, its export, and both
    models' log-probs of the held-out pairs, whose implicit rewards give the reward accuracy
    before and after."""
    workspace, refresh, preference = run.workspace, run.refresh, params.preference
    settings = preference.train
    name = stages.slug(params.model)

    def tokenize(source: str, files: list[str], split: str) -> StageArtifact:
        tag = stages.settings_tag(files, preference.data_format, preference.map_keys, params.template,
                                  preference.seq_length, preference.pack)
        return stages.run(tokenize_preference_task, PreferenceTokenizeConfig(
            input=pairs[split], tokenizer=tokenizer,
            format=preference.data_format, map_keys=preference.map_keys, template=params.template,
            seq_length=preference.seq_length, pack=preference.pack,
            out=workspace / "data" / name / f"{stages.slug(source)}-{split}-{tag}",
        ), refresh=refresh)

    def pair_logps(model: StageArtifact, model_name: str, dataset: StageArtifact, split: str) -> StageArtifact:
        # Named by its inputs (the model's and the pairs' files, the dtype), so that a retried or
        # rerun flow finds it; the optimizer settings are no input of log-probs (the layout and
        # LoRA, which the memory check counts, stay the alignment's).
        tag = stages.settings_tag(model.path, model.manifest.get("files"), dataset.path,
                                  dataset.manifest.get("files"), settings.dtype)
        config = settings.alignment_config(Path(model.path), workspace / "logps" / f"{model_name}-{split}-{tag}",
                                           Path(dataset.path), "dpo").model_copy(
            update={"steps": 1, "optim": OptimConfig(), "save_interval": None})
        return stages.run(pair_logps_task, config, nproc=settings.nproc, nnodes=settings.nnodes, launch=params.launch,
                          refresh=refresh)

    train_pairs = tokenize(preference.data, preference.data_files, "train")
    heldout_pairs = tokenize(preference.heldout_data, preference.heldout_data_files, "heldout")
    reference = pair_logps(sft, sft_name, train_pairs, "train") if params.method == "dpo" else None
    run_name = f"{sft_name}-{params.method}-" + stages.settings_tag(
        settings, params.method, sft.manifest.get("files"), train_pairs.manifest.get("files"))
    trained = stages.run(train_task, settings.alignment_config(
        Path(sft.path), workspace / "runs" / run_name, Path(train_pairs.path), params.method,
        Path(reference.path) if reference else None,
    ), nproc=settings.nproc, nnodes=settings.nnodes, launch=params.launch, refresh=refresh)
    exported = stages.run(export_task, ExportConfig(
        ckpt=Path(trained.path), out=workspace / "models" / run_name, merge_lora=settings.lora is not None,
    ), refresh=refresh)
    before = np.load(Path(pair_logps(sft, sft_name, heldout_pairs, "heldout").path) / LOGPS)
    after = np.load(Path(pair_logps(exported, run_name, heldout_pairs, "heldout").path) / LOGPS)
    beta = settings.preference.beta
    # Before alignment the dpo reward is the SFT model's log-ratio to itself: zero, no pair right.
    scored = {"before": reward_accuracy(before, before if params.method == "dpo" else None, params.method, beta),
              "after": reward_accuracy(after, before, params.method, beta)}
    rewards = {f"{key}_{when}": float(value) for when, scores in scored.items()
               for key, value in scores.items() if key != "pairs"}
    rewards["heldout_pairs"] = float(scored["after"]["pairs"])
    print(f"held-out reward accuracy ({params.method}, {scored['after']['pairs']} pairs): "
          f"{rewards['reward_accuracy_before']:.4f} before, {rewards['reward_accuracy_after']:.4f} after")
    return Alignment(params.method, trained, exported, run_name, settings.lora is not None, sft, rewards,
                     {"reference": reference.path if reference else None})


def reinforce(run: stages.FlowRun, params: FinetuneEvalParams, prompts: dict[str, Path], sft: StageArtifact,
              sft_name: str) -> Alignment:
    """The online RL alignment's stages after the SFT model's export ``sft`` (its run named
    ``sft_name``): the SFT model's held-out rewards, the GRPO run from the SFT model on the
    training prompts, its export, and its held-out rewards: the reward accuracy before and after."""
    workspace, refresh, settings = run.workspace, run.refresh, params.rl.train
    rl = settings.rl  # type: ignore[attr-defined]

    def heldout(model: StageArtifact, model_name: str) -> StageArtifact:
        tag = stages.settings_tag(model.path, model.manifest.get("files"), rl, str(prompts["heldout"]))
        return stages.run(heldout_rewards_task, HeldoutRewardsConfig(
            model=Path(model.path), prompts=prompts["heldout"], rl=rl,
            out=workspace / "rewards" / f"{model_name}-heldout-{tag}",
        ), refresh=refresh)

    before = heldout(sft, sft_name).manifest
    run_name = f"{sft_name}-grpo-" + stages.settings_tag(settings, sft.manifest.get("files"), str(prompts["train"]))
    trained = stages.run(train_task, settings.reinforce_config(  # type: ignore[attr-defined]
        Path(sft.path), workspace / "runs" / run_name, prompts["train"],
    ), nproc=settings.nproc, nnodes=settings.nnodes, launch=params.launch, refresh=refresh)
    exported = stages.run(export_task, ExportConfig(
        ckpt=Path(trained.path), out=workspace / "models" / run_name, merge_lora=settings.lora is not None,
    ), refresh=refresh)
    scored = {"before": before, "after": heldout(exported, run_name).manifest}
    rewards = {f"{key}_{when}": float(manifest[key]) for when, manifest in scored.items()
               for key in ("reward_accuracy", "reward")}
    rewards["heldout_prompts"] = float(scored["after"]["prompts"])
    print(f"held-out reward accuracy (grpo, {scored['after']['prompts']} prompts): "
          f"{rewards['reward_accuracy_before']:.4f} before, {rewards['reward_accuracy_after']:.4f} after")
    return Alignment("grpo", trained, exported, run_name, settings.lora is not None, sft, rewards, {})


def publish_comparison(mlflow_run: str, rows: list[ComparisonRow]) -> None:
    """The comparison as a Prefect table artifact, an MLflow table and the regression tag."""
    from mlflow import MlflowClient

    table = comparison_table(rows)
    tag = regression_tag(rows)
    create_table_artifact(key=f"{FLOW}-comparison", table=table,
                          description=f"Scores against the last registered model and the previous run; regression: {tag}")
    MlflowClient().log_table(mlflow_run, {key: [row[key] for row in table] for key in table[0]}, "comparison.json")
    tracking.set_tags(mlflow_run, {REGRESSION_TAG: tag})
