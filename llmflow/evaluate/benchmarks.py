"""The multiple-choice benchmarks one engine evaluates: where each one's questions come from,
how its prompts are worded, how its subjects are grouped, and which Hub files it needs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmflow.evaluate import categories, subjects_zh
from llmflow.evaluate.ceval_data import load_ceval
from llmflow.evaluate.cmmlu_data import load_cmmlu
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.prompts import (
    CEVAL_PROMPT,
    CMMLU_PROMPT,
    MMLU_PROMPT,
    PromptFormat,
)
from llmflow.evaluate.questions import BenchmarkData


@dataclass(frozen=True)
class Benchmark:
    """What sets one benchmark apart; everything else is the shared engine's."""

    name: str
    """Command and stage name (``llmflow eval NAME``, stage ``eval-NAME``)."""
    title: str
    """How the benchmark is named in messages."""
    load: Callable[[str | Path, list[str] | None], BenchmarkData]
    """Reads a local directory in any of the benchmark's layouts (restricted to some subjects)."""
    prompt: PromptFormat
    fewshot_split: str
    """The split the few-shot examples come from."""
    eval_split: str
    """The split evaluated."""
    categories: tuple[str, ...]
    """The categories results are grouped in; the last one also takes unlisted subjects."""
    subject_categories: Mapping[str, str]
    """Subject -> category."""
    hub_files: str
    """Glob of the Hub files a subject's split needs, with ``{subject}`` and ``{split}``."""
    hub_all: str
    """What ``{subject}`` is in ``hub_files`` when every subject is asked for."""

    @property
    def stage(self) -> str:
        """The stage name in manifests and MLflow."""
        return f"eval-{self.name}"

    def category_of(self, subject: str) -> str:
        """The category of ``subject``."""
        return self.subject_categories.get(subject, self.categories[-1])

    def hub_include(self, subjects: list[str] | None) -> list[str]:
        """Globs of the Hub files needed for ``subjects`` (all when empty)."""
        splits = (self.fewshot_split, self.eval_split)
        return sorted({self.hub_files.format(subject=s, split=split) for s in subjects or [self.hub_all] for split in splits})


def _categories(table: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    return {subject: category for subject, (_, category) in table.items()}


MMLU = Benchmark(
    name="mmlu", title="MMLU", load=load_mmlu, prompt=MMLU_PROMPT, fewshot_split="dev", eval_split="test",
    categories=categories.CATEGORIES, subject_categories=categories.SUBJECT_CATEGORY,
    # cais/mmlu: {subject}/{split}-00000-of-00001.parquet, every subject again in all/.
    hub_files="{subject}/{split}-*", hub_all="all",
)
CEVAL = Benchmark(
    name="ceval", title="C-Eval", load=load_ceval, prompt=CEVAL_PROMPT, fewshot_split="dev", eval_split="val",
    categories=subjects_zh.CATEGORIES, subject_categories=_categories(subjects_zh.CEVAL_SUBJECTS),
    # ceval/ceval-exam: {subject}/{split}-00000-of-00001.parquet.
    hub_files="{subject}/{split}-*", hub_all="*",
)
CMMLU = Benchmark(
    name="cmmlu", title="CMMLU", load=load_cmmlu, prompt=CMMLU_PROMPT, fewshot_split="dev", eval_split="test",
    categories=subjects_zh.CATEGORIES, subject_categories=_categories(subjects_zh.CMMLU_SUBJECTS),
    # haonan-li/cmmlu: every subject's CSVs in one archive, cmmlu_v1_0_1.zip.
    hub_files="*.zip", hub_all="*",
)
