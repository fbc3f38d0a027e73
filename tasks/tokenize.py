"""Prefect tasks for the tokenize stages."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from llmflow.data import tokenize_instruction as instruction
from llmflow.data import tokenize_preference as preference
from llmflow.data import tokenize_pretrain as pretrain
from llmflow.tasks.common import STAGE_CACHE_POLICY, InputFiles, StageArtifact, run_stage

TOKENIZE_CACHE_POLICY = STAGE_CACHE_POLICY + InputFiles(fields=("input", "tokenizer"))


@task(name=pretrain.STAGE, cache_policy=TOKENIZE_CACHE_POLICY)
def tokenize_pretrain_task(config: pretrain.PretrainTokenizeConfig) -> StageArtifact:
    """Tokenize pretraining text into ``{out}_text_document.bin/.idx``; tracked in MLflow."""
    return run_stage(pretrain.STAGE, config, pretrain.tokenize_pretrain, ("documents", "tokens", "tokens_per_s"))


@task(name=instruction.STAGE, cache_policy=TOKENIZE_CACHE_POLICY)
def tokenize_instruction_task(config: instruction.InstructionTokenizeConfig) -> StageArtifact:
    """Tokenize instruction data into ``{out}_packed_{input_ids,labels}_document``; tracked in MLflow."""
    metrics = ("samples", "written", "truncated", "dropped_overlong", "rows", "tokens", "trained_tokens", "packing_efficiency")
    return run_stage(instruction.STAGE, config, instruction.tokenize_instruction, metrics)


def _tokenize_preference(config: preference.PreferenceTokenizeConfig) -> Path:
    """``tokenize_preference``, returning its output prefix as ``run_stage`` expects."""
    return Path(preference.tokenize_preference(config)["data_prefix"])


@task(name=preference.STAGE, cache_policy=TOKENIZE_CACHE_POLICY)
def tokenize_preference_task(config: preference.PreferenceTokenizeConfig) -> StageArtifact:
    """Tokenize preference pairs into ``{out}_packed_{input_ids,labels}_document`` (chosen and
    rejected sequences of each pair consecutive); tracked in MLflow."""
    metrics = ("pairs", "written", "truncated", "dropped_overlong", "rows", "tokens", "trained_tokens", "packing_efficiency")
    return run_stage(preference.STAGE, config, _tokenize_preference, metrics)
