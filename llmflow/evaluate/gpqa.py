"""GPQA Diamond as lm-evaluation-harness 0.4.13 defines it: its ``gpqa_diamond_cot_zeroshot``
and ``gpqa_diamond_cot_n_shot`` tasks (version 2.2).

Both evaluate every row of ``gpqa_diamond.csv`` (the harness's only split, train) with its
four answers stripped, " [title]" made ". " and double spaces single (an empty answer is
" "), shuffled by ``random.shuffle`` in row order from Python's random module as the harness
seeds it (``random.seed(0)``) before its process_docs runs; the gold is the correct answer's
letter "(X)". Zero-shot: "What is the correct answer to this question:{Question}\\nChoices:\\n(A)
...\\n(D) {choice4}\\nLet's think step by step: "; n-shot: the description "Here are some example
questions from experts. ..." and "Question: {Question}\\n..." the same way. Neither sets
num_fewshot (the n-shot task's default is 0, as the zero-shot's); asked for shots, each
document's exemplars are drawn from the same rows by the harness's default seeded sampler,
which leaves out the document itself (the few-shot split is the evaluated one), each followed
by its gold. Generation until "</s>" (the harness's 256 tokens at most); two filters, scored by
exact match ignoring case and punctuation: ``strict-match``, the rest of the line after the
first "The answer is " less its last character, and ``flexible-extract``, the harness's
``multi_choice_regex``: the last "(X)", else the last answer text found in the generated text
(case and punctuation ignored), else the last letter after a colon.

The reader takes a local directory in the Hub layout of ``Idavidrein/gpqa``
(``gpqa_diamond.csv`` with columns Question, Correct Answer, Incorrect Answer 1-3, ...).
"""

from __future__ import annotations

import csv
import functools
import random
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmflow.evaluate.fewshot import fewshot_indices
from llmflow.evaluate.generative_tasks import Doc, ExactMatch, GenerativeGroup, GenerativeTask, RegexFilter, Scored
from llmflow.evaluate.questions import BenchmarkDataError, check_columns, describe

FILE = "gpqa_diamond.csv"
ANSWERS = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3", "Correct Answer")
COLUMNS = ("Question", *ANSWERS)
LAYOUT = f"Idavidrein/gpqa ({FILE} with columns {', '.join(COLUMNS)})"
SHUFFLE_SEED = 0
"""The seed of Python's random module in the harness's simple_evaluate (random_seed)."""
NA_VALUES = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                       "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})
"""The cells pandas reads as missing (the harness's csv loader reads the file with pandas)."""
N_SHOT_DESCRIPTION = ("Here are some example questions from experts. Answer the final question yourself, following "
                      "the format of the previous questions exactly.\n")


@dataclass(frozen=True)
class ChoiceDoc(Doc):
    """A document with its answers in the order shown."""

    choices: tuple[str, ...] = ()


def preprocess(text: str | None) -> str:
    """The harness's utils.preprocess of an answer."""
    if text is None:
        return " "
    return text.strip().replace(" [title]", ". ").replace("  ", " ")


def read_rows(directory: Path) -> list[dict[str, Any]]:
    """The rows of ``gpqa_diamond.csv`` under ``directory`` (missing cells None), each with its
    shuffled ``choices`` and gold ``answer`` (the harness's process_docs)."""
    path = directory / FILE
    if not path.is_file():
        shown = describe(directory) if directory.is_dir() else "no such directory"
        raise BenchmarkDataError(f"GPQA data {directory}: no {FILE}; {shown}; expected {LAYOUT}")
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        check_columns(str(path), list(reader.fieldnames or []), COLUMNS, LAYOUT)
        rows = [{k: None if v in NA_VALUES else v for k, v in row.items()} for row in reader]
    rnd = random.Random(SHUFFLE_SEED)
    for n, row in enumerate(rows, 2):
        if row["Question"] is None:
            raise BenchmarkDataError(f"{path} line {n}: no Question")
        choices = [preprocess(row[column]) for column in ANSWERS]
        rnd.shuffle(choices)
        row.update(choices=choices, answer=f"({chr(65 + choices.index(preprocess(row['Correct Answer'])))})")
    return rows


def zeroshot_text(row: dict[str, Any]) -> str:
    """gpqa_diamond_cot_zeroshot's doc_to_text."""
    a, b, c, d = row["choices"]
    return (f"What is the correct answer to this question:{row['Question']}\nChoices:\n(A) {a}\n(B) {b}\n(C) {c}\n"
            f"(D) {d}\nLet's think step by step: ")


def n_shot_text(row: dict[str, Any]) -> str:
    """gpqa_diamond_cot_n_shot's doc_to_text."""
    a, b, c, d = row["choices"]
    return f"Question: {row['Question']}\nChoices:\n(A) {a}\n(B) {b}\n(C) {c}\n(D) {d}\nLet's think step by step: "


def row_doc(row: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> ChoiceDoc:
    """A row as a document rendered by ``text``."""
    return ChoiceDoc(text(row), row["answer"], tuple(row["choices"]))


def read_docs(text: Callable[[dict[str, Any]], str], directory: Path) -> list[Doc]:
    """The documents of ``gpqa_diamond.csv`` under ``directory``, rendered by ``text``."""
    return [row_doc(row, text) for row in read_rows(directory)]


@dataclass(frozen=True)
class SampledRows:
    """Exemplars drawn from the rows themselves by the harness's default sampler, seeded, each
    document left out of its own."""

    text: Callable[[dict[str, Any]], str]
    shots: int = 0
    sampler: str = "lm-evaluation-harness default (seeded, n + 1 drawn per document, the document itself left out)"

    def __call__(self, directory: Path, docs: Sequence[Doc], shots: int) -> list[list[Doc]]:
        """The ``shots`` exemplars of each of ``docs`` (the first rows of the file)."""
        if not shots:
            return [[] for _ in docs]
        rows = read_rows(directory)
        try:
            picked = fewshot_indices(rows[:len(docs)], rows, shots)
        except ValueError as e:
            raise BenchmarkDataError(f"GPQA data {directory / FILE}: {e}") from None
        return [[row_doc(rows[i], self.text) for i in indices] for indices in picked]


@functools.cache
def punctuation_table() -> dict[int, None]:
    """Every Unicode punctuation character, to delete (the harness's punct_tbl)."""
    return dict.fromkeys(i for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith("P"))


@dataclass(frozen=True)
class MultiChoiceRegexFilter:
    """The harness's ``multi_choice_regex`` filter followed by ``take_first``."""

    name: str
    pattern: str
    group_select: int = 0
    fallback: str = "[invalid]"
    ignore_case: bool = False
    ignore_punctuation: bool = False
    regexes_to_ignore: tuple[str, ...] = ()

    @property
    def metric(self) -> str:
        """The key of the exact match under this filter in results.json."""
        return "exact_match_" + self.name.replace("-", "_")

    def ignoring(self, text: str) -> str:
        """``text`` less what the filter ignores (filter_ignores)."""
        for pattern in self.regexes_to_ignore:
            text = re.sub(pattern, "", text)
        if self.ignore_case:
            text = text.lower()
        if self.ignore_punctuation:
            text = text.translate(punctuation_table())
        return text

    def find(self, regex: re.Pattern[str], text: str, convert: dict[str, str] | None = None) -> str:
        """The selected match of ``regex`` (find_match): its first non-empty group, stripped,
        converted by ``convert``; "" when there is none."""
        matches = regex.findall(text)
        if not matches:
            return ""
        match = matches[self.group_select]
        if isinstance(match, tuple):
            non_empty = [m for m in match if m]
            if not non_empty:
                return ""
            match = non_empty[0]
        match = match.strip()
        return (convert or {}).get(match, match) if match else match

    def extract(self, text: str, choices: Sequence[str]) -> str:
        """The answer letter "(X)" of ``text`` for a document with ``choices``."""
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        keys = [self.ignoring(c.strip()) for c in choices]
        to_letter = {key: f"({letter})" for key, letter in zip(keys, letters)}
        by_text = re.compile("|".join(sorted((re.escape(k) for k in keys), key=len, reverse=True)))
        by_letter = re.compile(rf":[\s]*({'|'.join(letters)})")
        return (self.find(re.compile(self.pattern), text) or self.find(by_text, self.ignoring(text), to_letter)
                or self.find(by_letter, text, {letter: f"({letter})" for letter in letters}) or self.fallback)


@dataclass(frozen=True)
class ChoiceScorer:
    """Exact match of the strict and flexible filters' answers, the latter from the document's
    choices (a ``Scorer``)."""

    strict: RegexFilter
    flexible: MultiChoiceRegexFilter
    exact_match: ExactMatch
    metric: str = "exact_match_flexible_extract"

    def __call__(self, docs: Sequence[Doc], samples: list[list[str]], workers: int) -> list[Scored]:
        """Each document's answers from its first text (take_first) and whether they match the gold."""
        scored = []
        for doc, texts in zip(docs, samples):
            choices = doc.choices if isinstance(doc, ChoiceDoc) else ()
            extracted = {self.strict.name: self.strict.extract(texts[0]),
                         self.flexible.name: self.flexible.extract(texts[0], choices)}
            correct = {name: self.exact_match.score(answer, doc.target) == 1.0 for name, answer in extracted.items()}
            values = {self.strict.metric: float(correct[self.strict.name]),
                      self.flexible.metric: float(correct[self.flexible.name])}
            scored.append(Scored({"extracted": extracted, "gold": doc.target, "correct": correct}, values))
        return scored


STRICT = RegexFilter("strict-match", r"(?<=The answer is )(.*)(?=.)")
FLEXIBLE = MultiChoiceRegexFilter("flexible-extract", r"(\([A-Z]\))", group_select=-1, ignore_case=True,
                                  ignore_punctuation=True)
EXACT_MATCH = ExactMatch(ignore_case=True, ignore_punctuation=True)


def gpqa_task(name: str, description: str, text: Callable[[dict[str, Any]], str]) -> GenerativeTask:
    """One of the harness's gpqa_diamond chain-of-thought tasks."""
    return GenerativeTask(
        name=name, version="2.2", description=description, exemplars=(), fewshot=SampledRows(text),
        target_delimiter=" ", until=("</s>",), max_gen_toks=256,
        scorer=ChoiceScorer(STRICT, FLEXIBLE, EXACT_MATCH), subdir="", hub_include=(FILE,),
        read=functools.partial(read_docs, text),
    )


GPQA_DIAMOND = GenerativeGroup(
    name="gpqa-diamond", title="GPQA Diamond (chain of thought)", harness_name="gpqa_diamond_cot_zeroshot",
    tasks=(gpqa_task("gpqa_diamond_cot_zeroshot", "", zeroshot_text),
           gpqa_task("gpqa_diamond_cot_n_shot", N_SHOT_DESCRIPTION, n_shot_text)),
    headline_filter="flexible-extract", default_tasks=("gpqa_diamond_cot_zeroshot",), aggregate=False)
