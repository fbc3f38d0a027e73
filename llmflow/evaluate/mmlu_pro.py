"""MMLU-Pro as lm-evaluation-harness 0.4.13 defines it: its ``mmlu_pro`` group (version 2.0)
of 14 ``mmlu_pro_{category}`` tasks (version 3.1).

Each task evaluates the test rows of its category after the category's description and 5
worked exemplars: the first 5 validation rows of the same category (the ``first_n`` sampler),
each "Question:\\n{question}\\nOptions:\\nA. {option}\\n...Answer: Let's think step by step."
followed by its ``cot_content`` less its leading "A: Let's think step by step. "; the question
is rendered the same way without its answer. Up to 10 options (A-J), each stripped; generation
until "Question:" (2048 tokens at most); the answer is the first "answer is (X)" letter
(``custom-extract``), scored by exact match against the answer letter, ignoring case and
punctuation. The group's score is the size-weighted mean of its tasks'.

The reader takes a local directory in the Hub layout of ``TIGER-Lab/MMLU-Pro``:
``data/test-*.parquet`` and ``data/validation-*.parquet`` with columns question_id, question,
options, answer, answer_index, cot_content, category, src, every category in the same files.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from llmflow.evaluate.generative_tasks import Doc, ExactMatch, GenerativeGroup, GenerativeTask, RegexFilter
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_files import excerpt, read_split, split_files

CATEGORIES = ("biology", "business", "chemistry", "computer science", "economics", "engineering", "health",
              "history", "law", "math", "other", "philosophy", "physics", "psychology")
"""The categories as the ``category`` column names them (the harness's process_docs)."""
LETTERS = "ABCDEFGHIJ"
LAYOUT = ("TIGER-Lab/MMLU-Pro (data/{test,validation}-*.parquet with columns question, options, answer, "
          "cot_content, category)")
COLUMNS = ("question", "options", "answer", "category")
SHOTS = 5


def question_text(row: dict[str, Any]) -> str:
    """utils.format_cot_example without the answer: the question and its options (A-J), then
    "Answer: Let's think step by step." (the harness's doc_to_text and fewshot_to_text)."""
    options = "".join(f"{LETTERS[i]}. {option.strip()}\n" for i, option in enumerate(row["options"][:len(LETTERS)]))
    return f"Question:\n{row['question']}\nOptions:\n{options}Answer: Let's think step by step."


def exemplar_target(row: dict[str, Any]) -> str:
    """utils.fewshot_to_target: the worked answer less its "A: Let's think step by step. "."""
    return row["cot_content"].replace("A: Let's think step by step. ", "")


def checked_row(row: dict[str, Any], where: str, worked: bool) -> dict[str, Any]:
    """``row`` once its question, options, answer and category (and, for an exemplar, its
    cot_content) are of the harness's types."""
    options = row.get("options")
    texts = [row.get("question"), row.get("answer"), row.get("category"), *([row.get("cot_content")] if worked else [])]
    if not all(isinstance(t, str) for t in texts) or not isinstance(options, list) or not all(
            isinstance(o, str) for o in options):
        kind = "a question, an answer, a category" + (", a cot_content" if worked else "")
        raise BenchmarkDataError(f"{where}: expected {kind} (text) and options (a list of texts), got {excerpt(row)}")
    return row


SPLIT_FILES = ("data/{split}-*.parquet", "{split}-*.parquet")


@functools.lru_cache(maxsize=4)
def _split_rows(directory: Path, split: str, files: tuple[tuple[str, int, int], ...]) -> tuple[dict[str, Any], ...]:
    """Every checked row of ``split``; ``files`` (name, mtime, size) keys the cache, so the 14
    category tasks read a split's files once, and again only once they change."""
    worked = split == "validation"
    return tuple(read_split("MMLU-Pro", directory, split, (SPLIT_FILES,), COLUMNS + (("cot_content",) if worked else ()),
                            LAYOUT, partial(checked_row, worked=worked)))


def category_rows(directory: Path, split: str, category: str) -> list[dict[str, Any]]:
    """The rows of ``split`` under ``directory`` in ``category``, in file order."""
    files = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in split_files(directory, split, SPLIT_FILES))
    return [row for row in _split_rows(directory, split, files) if row["category"] == category]


def read_category(category: str, directory: Path) -> list[Doc]:
    """The test documents of ``category``: the question and its answer letter."""
    return [Doc(question_text(row), row["answer"]) for row in category_rows(directory, "test", category)]


@dataclass(frozen=True)
class FirstValidationRows:
    """The first validation rows of the task's category, the same for every document (the
    harness's first_n sampler over the validation split)."""

    category: str
    shots: int = SHOTS
    sampler: str = "first_n (the category's first validation rows, in file order)"

    def __call__(self, directory: Path, docs: Sequence[Doc], shots: int) -> list[list[Doc]]:
        """The first ``shots`` validation rows of the category as exemplars, for each of ``docs``."""
        rows = category_rows(directory, "validation", self.category) if shots else []
        if len(rows) < shots:
            raise BenchmarkDataError(f"MMLU-Pro data {directory}: {shots} shots asked for, the validation split has "
                                     f"{len(rows)} rows in category {self.category!r}")
        exemplars = [Doc(question_text(row), exemplar_target(row)) for row in rows[:shots]]
        return [exemplars for _ in docs]


def mmlu_pro_task(category: str) -> GenerativeTask:
    """The harness's ``mmlu_pro_{category}``."""
    return GenerativeTask(
        name=f"mmlu_pro_{category.replace(' ', '_')}", version="3.1",
        description=(f"The following are multiple choice questions (with answers) about {category}. Think step by "
                     'step and then finish your answer with "the answer is (X)" where X is the correct letter '
                     "choice.\n"),
        exemplars=(), fewshot=FirstValidationRows(category), target_delimiter=" ", until=("Question:",),
        max_gen_toks=2048, filters=(RegexFilter("custom-extract", r"answer is \(?([ABCDEFGHIJ])\)?"),),
        metric=ExactMatch(ignore_case=True, ignore_punctuation=True),
        subdir="", hub_include=("data/test-*", "data/validation-*"), read=partial(read_category, category),
    )


MMLU_PRO = GenerativeGroup(name="mmlu-pro", title="MMLU-Pro (chain of thought, 5-shot)", harness_name="mmlu_pro",
                           tasks=tuple(mmlu_pro_task(c) for c in CATEGORIES), headline_filter="custom-extract")
