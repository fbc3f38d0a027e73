"""The sample's MMLU-style set: multiple-choice questions about the world's facts, in the
``cais/mmlu`` parquet layout and the original MMLU CSV layout."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pyarrow as pa

from llmflow.evaluate.questions import LETTERS, Question
from llmflow.sample.parquet import write_parquet
from llmflow.sample.world import Fact

DEV_PER_SUBJECT = 5


def make_question(fact: Fact, rng: random.Random) -> Question:
    """``fact`` as a multiple-choice question: the answer in its slot, a random candidate of
    each other slot around it."""
    choices = tuple(fact.answer if i == fact.letter else rng.choice(slot) for i, slot in enumerate(fact.slots))
    return Question(subject=fact.subject, question=fact.question, choices=choices, answer=fact.letter)


def new_question(fact: Fact, rng: random.Random, taken: set[Question]) -> Question:
    """A question about ``fact`` not in ``taken``, unless the fact's choices run out."""
    q = make_question(fact, rng)
    for _ in range(64):
        if q not in taken:
            break
        q = make_question(fact, rng)
    return q


def _by_letter(facts: list[Fact]) -> list[Fact]:
    """``facts`` reordered so that consecutive facts cycle through the answer letters."""
    groups = [[f for f in facts if f.letter == k] for k in range(4)]
    out = []
    while any(groups):
        out += [g.pop() for g in groups if g]
    return out


def make_mmlu(
    rng: random.Random, facts: dict[str, list[Fact]], test_questions: int
) -> dict[str, dict[str, list[Question]]]:
    """{subject: {"dev": 5 questions, "test": ``test_questions``}}; dev and test ask about
    different facts, so a few-shot example never gives a test answer away. Test answers
    take each letter equally often (give or take one), and no test question repeats another
    while the facts' choices allow."""
    splits = {}
    for subject, subject_facts in facts.items():
        order = _by_letter(rng.sample(subject_facts, len(subject_facts)))
        dev_facts, test_facts = order[:DEV_PER_SUBJECT], order[DEV_PER_SUBJECT:]
        by_letter = [[f for f in test_facts if f.letter == k] for k in range(4)]
        test: list[Question] = []
        for i in range(test_questions):
            group = by_letter[i % 4]
            test.append(new_question(group[i // 4 % len(group)], rng, set(test)))
        rng.shuffle(test)
        splits[subject] = {"dev": [make_question(f, rng) for f in dev_facts], "test": test}
    return splits

def write_mmlu(mmlu: dict[str, dict[str, list[Question]]], directory: Path) -> None:
    """Both MMLU layouts: cais/mmlu parquet per subject and split, and the original CSVs."""
    schema = pa.schema(
        [
            ("question", pa.string()),
            ("subject", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("answer", pa.int64()),
        ]
    )
    for subject, splits in mmlu.items():
        for split, questions in splits.items():
            columns = {
                "question": [q.question for q in questions],
                "subject": [q.subject for q in questions],
                "choices": [list(q.choices) for q in questions],
                "answer": [q.answer for q in questions],
            }
            write_parquet(directory / "hf" / subject / f"{split}-00000-of-00001.parquet",
                           pa.table(columns, schema=schema))
            csv_path = directory / "csv" / "data" / split / f"{subject}_{split}.csv"
            csv_path.parent.mkdir(parents=True, exist_ok=True)
            with open(csv_path, "w", newline="", encoding="utf-8") as f:
                csv.writer(f).writerows([q.question, *q.choices, LETTERS[q.answer]] for q in questions)
