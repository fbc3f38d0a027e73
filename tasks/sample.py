"""Prefect task of the sample stage: the built-in offline assets every flow defaults to."""

from __future__ import annotations

from prefect import task

from llmflow.sample.assets import STAGE, SampleConfig, write_sample
from llmflow.tasks.common import STAGE_CACHE_POLICY, StageArtifact, run_stage


@task(name=STAGE, cache_policy=STAGE_CACHE_POLICY)
def sample_task(config: SampleConfig) -> StageArtifact:
    """Write the sample tokenizer, tiny model, corpus, instruction set and MMLU-style set
    into ``config.out``; deterministic, so the cache key is the config alone."""
    return run_stage(STAGE, config, write_sample, ())
