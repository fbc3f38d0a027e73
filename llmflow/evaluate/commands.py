"""``llmflow eval mmlu``, ``llmflow eval ceval`` and ``llmflow eval cmmlu``: one command per
benchmark, all on the shared engine."""

from __future__ import annotations

import json
from typing import ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliApp, CliSubCommand

from llmflow.evaluate.benchmarks import CEVAL, CMMLU, MMLU, Benchmark
from llmflow.evaluate.engine import EvalConfig, evaluate, format_table


class EvalCommand(EvalConfig):
    """Evaluate a model on ``benchmark``; prints the accuracy table."""

    benchmark: ClassVar[Benchmark]

    def cli_cmd(self) -> None:
        out = evaluate(self.benchmark, EvalConfig(**self.model_dump()))
        print(format_table(json.loads((out / "results.json").read_text())))
        print(f"wrote {out / 'results.json'} and {out / 'predictions.jsonl'}")


class MMLUCommand(EvalCommand):
    """Evaluate a model on MMLU with lm-evaluation-harness's prompts and scoring (test split);
    writes results.json and predictions.jsonl into --out and prints the accuracy table."""

    benchmark = MMLU


class CEvalCommand(EvalCommand):
    """Evaluate a model on C-Eval with lm-evaluation-harness's ceval-valid prompts and scoring
    (val split: the test answers are not public); writes results.json and predictions.jsonl
    into --out and prints the accuracy table."""

    benchmark = CEVAL


class CMMLUCommand(EvalCommand):
    """Evaluate a model on CMMLU with lm-evaluation-harness's prompts and scoring (test split);
    writes results.json and predictions.jsonl into --out and prints the accuracy table."""

    benchmark = CMMLU


class EvalCommands(BaseModel):
    """Evaluate models on benchmarks."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    mmlu: CliSubCommand[MMLUCommand]
    """MMLU accuracy with lm-evaluation-harness's prompts and scoring (results.json, predictions.jsonl)."""
    ceval: CliSubCommand[CEvalCommand]
    """C-Eval (val split) accuracy with lm-evaluation-harness's ceval-valid prompts and scoring."""
    cmmlu: CliSubCommand[CMMLUCommand]
    """CMMLU accuracy with lm-evaluation-harness's cmmlu prompts and scoring."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
