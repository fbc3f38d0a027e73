"""MMLU on the shared engine (``llmflow.evaluate.engine``), under the names the Prefect task
and ``bench/mmlu.py`` use."""

from __future__ import annotations

from pathlib import Path

from llmflow.evaluate import engine
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.questions import BenchmarkData, Question

STAGE = MMLU.stage


class MMLUConfig(engine.EvalConfig):
    """Evaluate a model on MMLU (lm-evaluation-harness's prompts and scoring)."""


def evaluate_mmlu(config: engine.EvalConfig) -> Path:
    """Evaluate ``config.model`` on MMLU; writes the results into ``config.out`` and returns it."""
    return engine.evaluate(MMLU, config)


def select_questions(data: BenchmarkData, limit: int | None) -> list[Question]:
    """The test questions to evaluate: every subject's (its first ``limit``), subjects sorted."""
    return engine.select_questions(MMLU, data, limit)


def prompts_for(questions: list[Question], data: BenchmarkData, shots: int) -> list[str]:
    """The plain-text MMLU prompt of every question."""
    return engine.prompts_for(MMLU, questions, data, shots)
