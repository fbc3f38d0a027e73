"""BoolQ and AGIEval sample data about the sample world, in their Hub layouts:

- ``boolq/boolq/{train,validation}-00000-of-00001.parquet`` (``aps/super_glue``'s boolq
  config: question, passage, idx, label): a passage stating a country's facts and a
  lower-case yes/no question about one of them, half of them true;
- ``agieval/agieval-logiqa-en/`` and ``agieval/agieval-sat-math/``, each
  ``data/test-00000-of-00001.parquet`` (``hails/agieval-*``: query, choices, gold) with the
  sample's geography and arithmetic facts as AGIEval words its queries.

They come from a random stream of their own, so adding them leaves every other sample
file as it was.
"""

from __future__ import annotations

import random
from pathlib import Path

from llmflow.evaluate.questions import LETTERS
from llmflow.sample.parquet import write_rows
from llmflow.sample.world import Country, Fact

BOOLQ_SPLITS = {"train": 24, "validation": 24}
AGIEVAL_TASKS = {"logiqa-en": "geography", "sat-math": "elementary_arithmetic"}
AGIEVAL_QUESTIONS = 12


def boolq_rows(rng: random.Random, world: list[Country], count: int) -> list[dict]:
    """Yes/no questions on the national animal or flag of a country, after a passage stating both."""
    rows = []
    for i in range(count):
        country = rng.choice(world)
        other = rng.choice([c for c in world if c.colour != country.colour and c.animal != country.animal])
        label = i % 2
        if rng.random() < 0.5:
            animal = country.animal if label else other.animal
            question = f"is the national animal of {country.name} the {animal}"
        else:
            colour = country.colour if label else other.colour
            question = f"is the flag of {country.name} {colour}"
        passage = (f"{country.name} is a country whose capital is {country.capital}. Its national animal is the "
                   f"{country.animal}, and its flag is {country.colour}.")
        rows.append({"question": question, "passage": passage, "idx": i, "label": label})
    rng.shuffle(rows)
    return [{**row, "idx": i} for i, row in enumerate(rows)]


def agieval_rows(rng: random.Random, facts: list[Fact], count: int) -> list[dict]:
    """Four-choice questions worded as hails/agieval's queries (the answer in its slot)."""
    rows = []
    for fact in rng.sample(facts, min(count, len(facts))):
        choices = [fact.answer if i == fact.letter else rng.choice(slot) for i, slot in enumerate(fact.slots)]
        options = [f"({LETTERS[i]}){choice}" for i, choice in enumerate(choices)]
        query = (f"Q: {fact.question} Answer Choices: {' '.join(options)}\n"
                 f"A: Among A through D, the answer is")
        rows.append({"query": query, "choices": options, "gold": [fact.letter]})
    return rows


def write_choice_tasks(seed: int, world: list[Country], facts: dict[str, list[Fact]], directory: Path) -> dict[str, int]:
    """Write the BoolQ and AGIEval sample data under ``directory``; their document counts."""
    rng = random.Random(f"{seed}-choice-tasks")
    counts = {}
    for split, count in BOOLQ_SPLITS.items():
        write_rows(directory / "boolq" / "boolq" / f"{split}-00000-of-00001.parquet", boolq_rows(rng, world, count))
        counts[f"boolq_{split}"] = count
    for task, subject in AGIEVAL_TASKS.items():
        rows = agieval_rows(rng, facts[subject], AGIEVAL_QUESTIONS)
        write_rows(directory / "agieval" / f"agieval-{task}" / "data" / "test-00000-of-00001.parquet", rows)
        counts[f"agieval_{task}"] = len(rows)
    return counts
