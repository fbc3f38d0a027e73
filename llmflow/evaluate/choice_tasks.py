"""Log-likelihood tasks whose documents carry their own choices, worded as
lm-evaluation-harness 0.4.13 words them:

- BoolQ: its ``boolq`` task (super_glue, task version 2.0): "{passage}\\nQuestion: {question}?\\nAnswer:",
  choices "no" and "yes", few-shot examples drawn from the train split, validation evaluated.
- AGIEval, English multiple-choice: the nine log-likelihood tasks of its ``agieval_en`` group
  (task version 1.0; the group's tenth, ``agieval_math``, is generative): "{query}", the
  document's own choices, zero-shot on the test split, ``acc`` and ``acc_norm``.

A reader takes a local directory in the Hub layout of the task's dataset (``aps/super_glue``'s
``boolq/{split}-*.parquet``; ``hails/agieval-*``'s ``{split}-*.parquet`` anywhere below the
task's directory) or, for BoolQ, the original ``train.jsonl``/``dev.jsonl`` of google/boolq,
whose rows are read as super_glue's rows of them (below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_files import excerpt, read_split


@dataclass(frozen=True)
class Doc:
    """One document as the harness renders it."""

    text: str
    """The prompt of the document (the task's doc_to_text)."""
    choices: tuple[str, ...]
    """The answers scored, each after the target delimiter " "."""
    gold: tuple[int, ...]
    """Indices of the right choices (AGIEval's gold is a list; BoolQ's label one index)."""
    row: dict[str, Any]
    """The document's fields as the harness loads them. The harness leaves the evaluated document
    out of its few-shot examples by comparing whole rows, so a copy under another ``idx`` stays."""


@dataclass(frozen=True)
class ChoiceTask:
    """One task: where its documents are and how they read."""

    name: str
    """lm-evaluation-harness's task name (``boolq``, ``agieval_lsat_ar``)."""
    version: str
    """The harness's version of the task followed."""
    hub_repo: str
    """The dataset on the Hugging Face Hub."""
    hub_include: tuple[str, ...]
    """Globs of the Hub files the task reads."""
    eval_split: str
    fewshot_split: str | None
    """Where few-shot examples come from (None: the harness runs the task zero-shot only)."""
    metrics: tuple[str, ...]
    """``acc`` and, where the harness reports it, ``acc_norm`` (log-likelihood / choice length in characters)."""
    read: Callable[[Path, str], list[Doc]]
    """Documents of a split, from the task's local directory."""


@dataclass(frozen=True)
class TaskGroup:
    """What ``llmflow eval NAME`` evaluates: one task or a group of them."""

    name: str
    """Command and stage name (``llmflow eval NAME``, stage ``eval-NAME``)."""
    title: str
    tasks: tuple[ChoiceTask, ...]
    hub_root: str
    """The hub source that stands for every task's dataset (``hf://hails`` for hails/agieval-*)."""
    local_dir: Callable[[Path, ChoiceTask], Path]
    """A task's directory inside the group's local data directory."""

    @property
    def stage(self) -> str:
        """The stage name in manifests and MLflow."""
        return f"eval-{self.name}"


# --- BoolQ -------------------------------------------------------------------------------------

BOOLQ_LAYOUTS = ("aps/super_glue (boolq/{train,validation}-*.parquet) or google/boolq (train.jsonl, dev.jsonl)")
_BOOLQ_ORIGINAL_SPLITS = {"train": "train", "validation": "dev"}


def checked_boolq_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """``row`` when it is a super_glue row (label 0/1) or an original one (title, answer true/false)."""
    label = row.get("label", row.get("answer"))
    if (not isinstance(row.get("passage"), str) or not isinstance(row.get("question"), str) or label not in (0, 1)
            or ("label" not in row and not isinstance(row.get("title"), str))):
        raise BenchmarkDataError(f"{where}: expected a passage, a question and a label 0/1 (or google/boolq's "
                                 f"title and answer false/true), got {excerpt(row)}")
    return row


def super_glue_row(row: dict[str, Any], position: int) -> dict[str, Any]:
    """``row`` as super_glue holds it: a super_glue row as it is; an original one with
    super_glue's passage "{title} -- {passage}", its label, and its ``position`` in the file as
    ``idx`` (super_glue numbers each split's rows from 0)."""
    if "label" in row:
        return row
    return {"question": row["question"], "passage": f"{row['title']} -- {row['passage']}", "idx": position,
            "label": int(row["answer"])}


def boolq_doc(row: dict[str, Any]) -> Doc:
    """A BoolQ document from its super_glue row."""
    return Doc(f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ("no", "yes"), (int(row["label"]),), row)


def read_boolq(root: Path, split: str) -> list[Doc]:
    """The BoolQ documents of ``split`` under ``root`` in either layout."""
    original = (f"{_BOOLQ_ORIGINAL_SPLITS[split]}.jsonl",) if split in _BOOLQ_ORIGINAL_SPLITS else ()
    rows = read_split("BoolQ", root, split, (("boolq/{split}-*.parquet", "{split}-*.parquet"), original),
                      ("passage", "question", "label"), BOOLQ_LAYOUTS, checked_boolq_row)
    return [boolq_doc(super_glue_row(row, n)) for n, row in enumerate(rows)]


BOOLQ_TASK = ChoiceTask(
    name="boolq", version="2.0", hub_repo="aps/super_glue", hub_include=("boolq/train-*", "boolq/validation-*"),
    eval_split="validation", fewshot_split="train", metrics=("acc",), read=read_boolq,
)
BOOLQ = TaskGroup(name="boolq", title="BoolQ", tasks=(BOOLQ_TASK,), hub_root="hf://aps/super_glue",
                  local_dir=lambda root, task: root)


# --- AGIEval -----------------------------------------------------------------------------------

AGIEVAL_LAYOUT = "hails/agieval-* (test-*.parquet with columns query, choices, gold)"


def agieval_doc(row: dict[str, Any], where: str) -> Doc:
    """An AGIEval document: its query, its choices and the indices in ``gold``."""
    query, choices, gold = row.get("query"), row.get("choices"), row.get("gold")
    if (not isinstance(query, str) or not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(c, str) for c in choices) or not isinstance(gold, list) or not gold
            or not all(isinstance(g, int) and 0 <= g < len(choices) for g in gold)):
        raise BenchmarkDataError(f"{where}: expected a query, a list of at least two choices and gold, a "
                                 f"non-empty list of choice indices; got {excerpt(row)}")
    return Doc(query, tuple(choices), tuple(gold), row)


def read_agieval(root: Path, split: str) -> list[Doc]:
    """The documents of one AGIEval task's ``split`` under its directory ``root``."""
    return read_split("AGIEval", root, split, (("**/{split}-*.parquet", "**/{split}.jsonl"),),
                      ("query", "choices", "gold"), AGIEVAL_LAYOUT, agieval_doc)


AGIEVAL_EN_TASKS = ("aqua-rat", "gaokao-english", "logiqa-en", "lsat-ar", "lsat-lr", "lsat-rc", "sat-en",
                    "sat-en-without-passage", "sat-math")
AGIEVAL = TaskGroup(
    name="agieval", title="AGIEval (English, multiple choice)",
    tasks=tuple(
        ChoiceTask(name=f"agieval_{t.replace('-', '_')}", version="1.0", hub_repo=f"hails/agieval-{t}",
                   hub_include=("*test-*",), eval_split="test", fewshot_split=None, metrics=("acc", "acc_norm"),
                   read=read_agieval)
        for t in AGIEVAL_EN_TASKS
    ),
    hub_root="hf://hails",
    local_dir=lambda root, task: root / task.hub_repo.split("/")[1],
)
