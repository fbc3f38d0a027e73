"""MMLU-Pro and GPQA Diamond sample data about the sample world, in their Hub layouts:

- ``mmlu-pro/data/validation-00000-of-00001.parquet`` and ``mmlu-pro/data/test-00000-of-00001.parquet``
  (``TIGER-Lab/MMLU-Pro``: question_id, question, options, answer, answer_index, cot_content,
  category, src): questions about the countries' capitals, animals and flags in three
  categories, with 10 options (some with 8; the countries' other values, alone or with the right one), the validation rows with worked answers
  ("A: Let's think step by step. ... The answer is (X).") as MMLU-Pro's, the test rows with none;
- ``gpqa-diamond/gpqa_diamond.csv`` (``Idavidrein/gpqa``: Question, Correct Answer, Incorrect Answer
  1-3, Record ID, Subdomain): four-answer questions about the countries, some answers with
  GPQA's " [title]" and double spaces.

They come from a random stream of their own, so adding them leaves every other sample file
as it was.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from llmflow.sample.parquet import write_rows
from llmflow.sample.world import Country

MMLU_PRO_CATEGORIES = ("history", "other", "computer science")
MMLU_PRO_SPLITS = {"validation": 5, "test": 6}
"""Rows per category: the harness takes 5 validation rows as exemplars."""
GPQA_QUESTIONS = 10
LETTERS = "ABCDEFGHIJ"
_ASPECTS = (("capital", "What is the capital of {name}?"), ("animal", "Which animal is on the coat of arms of {name}?"),
            ("colour", "What colours are on the flag of {name}?"))


def mmlu_pro_row(rng: random.Random, world: list[Country], number: int, category: str, worked: bool) -> dict:
    """One MMLU-Pro row about a country: the right value and others from the world."""
    country = rng.choice(world)
    aspect, question = rng.choice(_ASPECTS)
    right = getattr(country, aspect)
    others = sorted({getattr(c, aspect) for c in world} - {right})
    wrong = [*others, *(f"{value} and {right}" for value in others)]
    options = [right, *rng.sample(wrong, min(len(wrong), 7 if number % 5 == 3 else 9))]
    rng.shuffle(options)
    index = options.index(right)
    cot = (f"A: Let's think step by step. {country.name} has {right} as its {aspect}. "
           f"The answer is ({LETTERS[index]})." if worked else "")
    return {"question_id": number, "question": question.format(name=country.name), "options": options,
            "answer": LETTERS[index], "answer_index": index, "cot_content": cot, "category": category,
            "src": f"sample-{category.replace(' ', '_')}"}


def write_mmlu_pro(seed: int, world: list[Country], directory: Path) -> dict[str, int]:
    """Write the MMLU-Pro sample data under ``directory / "mmlu-pro"``; its row counts by split."""
    rng = random.Random(f"{seed}-mmlu-pro")
    number = 0
    counts = {}
    for split, per_category in MMLU_PRO_SPLITS.items():
        rows = []
        for category in MMLU_PRO_CATEGORIES:
            for _ in range(per_category):
                rows.append(mmlu_pro_row(rng, world, number, category, split == "validation"))
                number += 1
        write_rows(directory / "mmlu-pro" / "data" / f"{split}-00000-of-00001.parquet", rows)
        counts[f"mmlu_pro_{split}"] = len(rows)
    return counts


def write_gpqa(seed: int, world: list[Country], directory: Path) -> dict[str, int]:
    """Write the GPQA Diamond sample data under ``directory / "gpqa-diamond"``; its row count."""
    rng = random.Random(f"{seed}-gpqa")
    rows = []
    for n in range(GPQA_QUESTIONS):
        country = rng.choice(world)
        aspect, question = rng.choice(_ASPECTS)
        right = getattr(country, aspect)
        others = sorted({getattr(c, aspect) for c in world} - {right})
        wrong = rng.sample(others, 3) if len(others) >= 3 else [f"not {right} ({i})" for i in range(3)]
        if n % 4 == 1:
            right = f"{right} [title] as recorded"
        if n % 4 == 2:
            wrong[0] = f" {wrong[0]}  or none "
        rows.append({"Question": question.format(name=country.name), "Correct Answer": right,
                     **{f"Incorrect Answer {i}": w for i, w in enumerate(wrong, 1)},
                     "Record ID": f"rec{n:04d}", "Subdomain": aspect})
    path = directory / "gpqa-diamond" / "gpqa_diamond.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return {"gpqa_diamond": len(rows)}
