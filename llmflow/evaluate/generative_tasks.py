"""Generative tasks with chain-of-thought few-shot prompts, as lm-evaluation-harness 0.4.13
defines them:

- GSM8K: its ``gsm8k_cot`` task (version 3.0): the 8 fixed exemplars of gsm8k-cot.yaml as
  "Q: {question}\\nA: {target}\\n\\n", then "Q: {question}\\nA:"; generation until "Q:",
  "</s>" or "<|im_end|>" (256 tokens at most, the hf backend's default); the answer taken by
  the ``strict-match`` filter ("The answer is N.") and the ``flexible-extract`` filter (the
  last number), each scored by exact match against the text after the answer's "####",
  ignoring case, commas, "$", everything up to "#### " and a final ".".
- BBH: its ``bbh_cot_fewshot`` group (tasks version 4.0, group 3.0): per subtask, its
  description, then its 3 exemplars as "Q: {input}\\nA: Let's think step by step.\\n{target}\\n\\n",
  then the question the same way; generation until "</s>", "Q" or "\\n\\n" (1024 tokens at
  most); the answer is the rest of the line after the first "the answer is ", less its last
  character, normally a full stop (``get-answer``), scored by exact match against the target.

The exemplars are the harness's own text (``cot_exemplars.py``). A reader takes a local
directory in the Hub layout of the task's dataset (``openai/gsm8k``'s ``main/test-*.parquet``;
``SaylorTwift/bbh``'s ``{subtask}/test-*.parquet``) or, for GSM8K, the ``test.jsonl`` of the
GSM8K release.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from llmflow.evaluate.chat_context import PLAIN_PROMPTS, Example, PromptRenderer
from llmflow.evaluate.cot_exemplars import BBH_COT_FEWSHOT, GSM8K_COT
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_files import excerpt, read_split


@dataclass(frozen=True)
class Doc:
    """One document, or one few-shot exemplar, as the harness renders it."""

    text: str
    """The prompt of the document (the task's doc_to_text)."""
    target: str
    """The gold answer (doc_to_target); an exemplar's is its worked solution."""


@dataclass(frozen=True)
class RegexFilter:
    """The harness's ``regex`` filter followed by ``take_first``: the answer extracted from a
    generated text."""

    name: str
    """The filter's name in the harness (it names the metric: ``exact_match,{name}``)."""
    pattern: str
    group_select: int = 0
    """Which match to take (-1: the last)."""
    fallback: str = "[invalid]"

    @property
    def metric(self) -> str:
        """The key of the exact match under this filter in results.json."""
        return "exact_match_" + self.name.replace("-", "_")

    def extract(self, text: str) -> str:
        """The selected match, the first non-empty group of a pattern with several, stripped."""
        matches = re.findall(self.pattern, text)
        if not matches:
            return self.fallback
        match = matches[self.group_select]
        if isinstance(match, tuple):
            match = next((m for m in match if m), self.fallback)
        return match.strip()


@dataclass(frozen=True)
class ExactMatch:
    """The harness's exact_match metric with its options."""

    ignore_case: bool = False
    ignore_punctuation: bool = False
    regexes_to_ignore: tuple[str, ...] = ()
    """Removed (re.sub) from the answer and the gold before they are compared."""

    def score(self, prediction: str, reference: str) -> float:
        """1.0 when the answer equals the gold, else 0.0."""
        # The harness's own steps on numpy string arrays, whose quirks decide edge cases: an array
        # drops trailing NULs, and np.char.lower keeps each string's length.
        predictions: Any = [prediction]
        references: Any = [reference]
        for pattern in self.regexes_to_ignore:
            predictions = np.array([re.sub(pattern, "", x) for x in predictions])
            references = np.array([re.sub(pattern, "", x) for x in references])
        predictions, references = np.asarray(predictions), np.asarray(references)
        if self.ignore_case:
            predictions, references = np.char.lower(predictions), np.char.lower(references)
        if self.ignore_punctuation:
            table = str.maketrans("", "", string.punctuation)
            predictions, references = np.char.translate(predictions, table), np.char.translate(references, table)
        return float(predictions[0] == references[0])


@dataclass(frozen=True)
class Scored:
    """One document's score."""

    record: dict[str, Any]
    """What predictions.jsonl says of it beside the generated text."""
    values: dict[str, float]
    """Each metric's value, by its key in results.json (the task reports their means)."""


class ExemplarSource(Protocol):
    """Few-shot exemplars drawn from a task's data (the harness's few-shot split and sampler)
    instead of fixed ones."""

    shots: int
    """The harness's num_fewshot: the exemplars taken unless another number is asked for."""
    sampler: str
    """How the exemplars are chosen, as results.json records it."""

    def __call__(self, directory: Path, docs: Sequence[Doc], shots: int) -> list[list[Doc]]:
        """The ``shots`` exemplars of each of ``docs`` (the first of the task's documents, in
        order), from the task's directory."""
        ...


class Scorer(Protocol):
    """Scores a task's generated texts otherwise than by its filters' exact match (HumanEval's
    execution of the generated code). A scorer with an ``aggregate(scores)`` method reports the
    task's metrics itself (IFEval's instruction-level accuracies); else each is the mean of the
    documents' values with its standard error."""

    metric: str
    """The key of its headline metric in results.json."""

    def __call__(self, docs: Sequence[Doc], samples: list[list[str]], workers: int) -> list[Scored]:
        """Each document's score from its generated texts (one per sample); ``workers``: how
        many programs may run at once."""
        ...


@dataclass(frozen=True, kw_only=True)
class GenerativeTask:
    """One task: its prompt, its generation settings, its filters and metric (or its scorer),
    its data."""

    name: str
    """lm-evaluation-harness's task name (``gsm8k_cot``, ``bbh_cot_fewshot_navigate``)."""
    version: str
    """The harness's version of the task followed."""
    description: str
    """Text before the exemplars."""
    exemplars: tuple[Doc, ...]
    """The fixed few-shot examples, taken in order (the harness's first_n sampler)."""
    target_delimiter: str
    """Between an exemplar's text and its target."""
    until: tuple[str, ...]
    """Stop strings: the generated text is cut before the first of them."""
    max_gen_toks: int
    """The most tokens generated by default."""
    subdir: str
    """The task's directory inside its group's data ("" for the data directory itself)."""
    hub_include: tuple[str, ...]
    """Globs of the Hub files the task reads."""
    read: Callable[[Path], list[Doc]]
    """The evaluated documents, from the task's directory."""
    repeats: int = 1
    """Texts generated per document (the harness's ``repeats``)."""
    temperature: float = 0.0
    """Sampling temperature (the harness's ``do_sample`` with its temperature); 0: greedy."""
    top_p: float = 1.0
    """Nucleus sampling's top_p when sampling."""
    min_repeats: int = 1
    """The fewest texts per document its metrics take (pass@2 needs two)."""
    filters: tuple[RegexFilter, ...] = ()
    metric: ExactMatch = ExactMatch()
    scorer: Scorer | None = None
    """Scores the generated texts instead of the filters' exact match."""
    fewshot: ExemplarSource | None = None
    """Draws each document's exemplars from the data instead of taking the fixed ``exemplars``."""

    def prompt(self, doc: Doc, shots: int, renderer: PromptRenderer = PLAIN_PROMPTS,
               exemplars: Sequence[Doc] | None = None) -> str:
        """The description, the first ``shots`` exemplars (``exemplars``, the document's own,
        else the fixed ones) with their targets, then the document, rendered under the run's
        chat settings."""
        chosen = self.exemplars if exemplars is None else exemplars
        examples = [Example(e.text, e.target) for e in chosen[:shots]]
        return renderer.prompt(self.description, examples, doc.text, self.name, self.target_delimiter)

    def score(self, docs: Sequence[Doc], samples: list[list[str]], workers: int) -> list[Scored]:
        """Each document's score from its generated texts: its scorer's, else each filter's
        answer from the first text (the harness's take_first) and its exact match."""
        if self.scorer is not None:
            return self.scorer(docs, samples, workers)
        return [self.exact_match(doc, texts[0]) for doc, texts in zip(docs, samples)]

    def exact_match(self, doc: Doc, text: str) -> Scored:
        """Each filter's answer and whether it matches the gold."""
        extracted = {f.name: f.extract(text) for f in self.filters}
        correct = {name: self.metric.score(answer, doc.target) == 1.0 for name, answer in extracted.items()}
        return Scored({"extracted": extracted, "gold": doc.target, "correct": correct},
                      {f.metric: float(correct[f.name]) for f in self.filters})


@dataclass(frozen=True)
class GenerativeGroup:
    """What ``llmflow eval NAME`` evaluates: one task or a group of them."""

    name: str
    """Command and stage name (``llmflow eval NAME``, stage ``eval-NAME``)."""
    title: str
    harness_name: str
    """The harness's name of the task or group."""
    tasks: tuple[GenerativeTask, ...]
    headline_filter: str
    """The filter whose exact match is the headline (a group's: its micro average, the
    harness's size-weighted group score); for a task with a scorer, the harness's filter name
    (the scorer's metric is the headline)."""
    default_tasks: tuple[str, ...] = ()
    """The tasks evaluated unless others are asked for (empty: all)."""
    aggregate: bool = True
    """Whether the group reports micro and macro averages of its tasks (tasks of one kind)."""

    @property
    def stage(self) -> str:
        """The stage name in manifests and MLflow."""
        return f"eval-{self.name}"

    def headline_metric(self, task: GenerativeTask) -> str:
        """The key of the headline metric in ``task``'s results."""
        if task.scorer is not None:
            return task.scorer.metric
        return next(f.metric for f in task.filters if f.name == self.headline_filter)


# --- GSM8K -------------------------------------------------------------------------------------

GSM8K_LAYOUTS = "openai/gsm8k (main/test-*.parquet with columns question, answer) or GSM8K's own test.jsonl"


def gsm8k_text(question: str) -> str:
    """gsm8k_cot's doc_to_text."""
    return f"Q: {question}\nA:"


def gsm8k_doc(row: dict[str, Any], where: str) -> Doc:
    """A GSM8K document; its gold is the answer after its last "####" (all of it when it has none)."""
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        raise BenchmarkDataError(f"{where}: expected a question and an answer (text), got {excerpt(row)}")
    return Doc(gsm8k_text(question), answer.split("####")[-1].strip())


def read_gsm8k(root: Path) -> list[Doc]:
    """The GSM8K test documents under ``root`` in either layout."""
    return read_split("GSM8K", root, "test", (("main/{split}-*.parquet", "{split}-*.parquet"), ("{split}.jsonl",)),
                      ("question", "answer"), GSM8K_LAYOUTS, gsm8k_doc)


GSM8K_COT_TASK = GenerativeTask(
    name="gsm8k_cot", version="3.0", description="",
    exemplars=tuple(Doc(gsm8k_text(e["question"]), e["target"]) for e in GSM8K_COT),
    target_delimiter=" ", until=("Q:", "</s>", "<|im_end|>"), max_gen_toks=256,
    filters=(RegexFilter("strict-match", r"The answer is (\-?[0-9\.\,]+)."),
             RegexFilter("flexible-extract", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)),
    metric=ExactMatch(ignore_case=True, regexes_to_ignore=(",", r"\$", "(?s).*#### ", r"\.$")),
    subdir="", hub_include=("main/test-*",), read=read_gsm8k,
)
GSM8K = GenerativeGroup(name="gsm8k", title="GSM8K (chain of thought)", harness_name="gsm8k_cot",
                        tasks=(GSM8K_COT_TASK,), headline_filter="strict-match")


# --- BBH ---------------------------------------------------------------------------------------

BBH_LAYOUT = "SaylorTwift/bbh ({subtask}/test-*.parquet with columns input, target)"


def bbh_text(question: str) -> str:
    """The doc_to_text of every bbh_cot_fewshot task."""
    return f"Q: {question}\nA: Let's think step by step.\n"


def bbh_doc(row: dict[str, Any], where: str) -> Doc:
    """A BBH document: its input and its target."""
    question, target = row.get("input"), row.get("target")
    if not isinstance(question, str) or not isinstance(target, str):
        raise BenchmarkDataError(f"{where}: expected an input and a target (text), got {excerpt(row)}")
    return Doc(bbh_text(question), target)


def read_bbh(directory: Path) -> list[Doc]:
    """The test documents of one BBH subtask, from its directory."""
    return read_split("BBH", directory, "test", (("{split}-*.parquet",),), ("input", "target"), BBH_LAYOUT, bbh_doc)


def bbh_task(subtask: str) -> GenerativeTask:
    """The harness's ``bbh_cot_fewshot_{subtask}``."""
    prompts = BBH_COT_FEWSHOT[subtask]
    return GenerativeTask(
        name=f"bbh_cot_fewshot_{subtask}", version="4.0", description=prompts["description"],
        exemplars=tuple(Doc(bbh_text(e["input"]), e["target"]) for e in prompts["samples"]),
        target_delimiter="", until=("</s>", "Q", "\n\n"), max_gen_toks=1024,
        filters=(RegexFilter("get-answer", r"(?<=the answer is )(.*)(?=.)"),), metric=ExactMatch(),
        subdir=subtask, hub_include=(f"{subtask}/test-*",), read=read_bbh,
    )


BBH = GenerativeGroup(name="bbh", title="BBH (chain of thought, few-shot)", harness_name="bbh_cot_fewshot",
                      tasks=tuple(bbh_task(s) for s in BBH_COT_FEWSHOT), headline_filter="get-answer")
