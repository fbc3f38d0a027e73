"""The sample's preference set, in TRL's pairwise text layout (prompt, chosen, rejected):
questions about the world's facts, the correct statement chosen and a wrong statement of
the same form rejected (another country's capital or name, another animal or colour, a
sum off by one to four).

- ``preference/preference_train.{jsonl,parquet}``: each fact asked in three wordings, each
  wording with three different wrong answers (432 pairs for the default 8 countries);
- ``preference/preference_heldout.{jsonl,parquet}``: the same facts asked in two other
  wordings, one pair each (96 pairs), its wrong answer one of the fact's training pairs',
  so that a model that learnt from the training pairs which statement is true ranks the
  held-out pairs too: they differ from training pairs only in how the question is worded.

The chosen statements are the world's fact statements, worded as the instruction set words
them. They come from a random stream of their own, so adding them leaves every other
sample file as it was.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from llmflow.sample.parquet import write_jsonl, write_parquet
from llmflow.sample.world import ANIMALS, COLOURS, Country, Fact

COLUMNS = ("prompt", "chosen", "rejected")
TRAIN_WORDINGS = 3
"""The first wordings of each kind of question are the training ones, the rest held out."""
WRONG_PER_WORDING = 3
"""Training pairs per fact and training wording, each with another wrong answer."""

# Per kind of fact: the statement (the fact's, with {value} its answer) and the question
# wordings, three for training and two held out.
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "capital": ("The capital of {country} is {value}.", (
        "What is the capital of {country}?",
        "Which city is the capital of {country}?",
        "Name the capital of {country}.",
        "Tell me the capital city of {country}.",
        "What city is {country}'s capital?",
    )),
    "country": ("{capital} is the capital of {value}.", (
        "{capital} is the capital of which country?",
        "Which country has {capital} as its capital?",
        "Of which country is {capital} the capital?",
        "Name the country whose capital is {capital}.",
        "{capital} is the capital city of what country?",
    )),
    "animal": ("The national animal of {country} is the {value}.", (
        "What is the national animal of {country}?",
        "Which animal is the national animal of {country}?",
        "Name the national animal of {country}.",
        "Tell me the national animal of {country}.",
        "What animal does {country} have as its national animal?",
    )),
    "colour": ("The flag of {country} is {value}.", (
        "What colour is the flag of {country}?",
        "Which colour is the flag of {country}?",
        "Name the colour of the flag of {country}.",
        "Tell me the colour of the flag of {country}.",
        "What is the colour of {country}'s flag?",
    )),
    "sum": ("{a} + {b} = {value}.", (
        "What is {a} + {b}?",
        "How much is {a} + {b}?",
        "Compute {a} + {b}.",
        "Tell me the sum of {a} and {b}.",
        "What do {a} and {b} add up to?",
    )),
}


def questions(world: list[Country], facts: dict[str, list[Fact]]) -> Iterator[tuple[str, dict[str, str], str, list[str]]]:
    """(kind, fields, answer, wrong answers) of every fact."""
    capitals, names = [c.capital for c in world], [c.name for c in world]
    for c in world:
        yield "capital", {"country": c.name}, c.capital, [x for x in capitals if x != c.capital]
        yield "country", {"capital": c.capital}, c.name, [x for x in names if x != c.name]
        yield "animal", {"country": c.name}, c.animal, [x for x in ANIMALS if x != c.animal]
        yield "colour", {"country": c.name}, c.colour, [x for x in COLOURS if x != c.colour]
    for fact in facts["elementary_arithmetic"]:
        match = re.fullmatch(r"What is (\d+) \+ (\d+)\?", fact.question)
        assert match, fact.question
        a, b = match.groups()
        total = int(fact.answer)
        yield "sum", {"a": a, "b": b}, fact.answer, [str(n) for n in range(max(0, total - 4), total + 5) if n != total]


def make_preferences(seed: int, world: list[Country], facts: dict[str, list[Fact]]) -> dict[str, list[dict[str, str]]]:
    """The ``train`` and ``heldout`` pairs, each split in random order."""
    rng = random.Random(f"{seed}-preferences")
    statements = {f.statement for subject in facts.values() for f in subject}
    splits: dict[str, list[dict[str, str]]] = {"train": [], "heldout": []}
    for kind, fields, answer, wrong in questions(world, facts):
        statement, wordings = KINDS[kind]
        chosen = statement.format(**fields, value=answer)
        assert chosen in statements, chosen  # the world's own statement of the fact
        trained: list[str] = []  # the wrong answers of the training pairs, in order of first use
        for i, wording in enumerate(wordings):
            if i < TRAIN_WORDINGS:
                split, values = "train", rng.sample(wrong, WRONG_PER_WORDING)
                trained += [v for v in values if v not in trained]
            else:
                split, values = "heldout", [rng.choice(trained)]
            for value in values:
                rejected = statement.format(**fields, value=value)
                splits[split].append({"prompt": wording.format(**fields), "chosen": chosen, "rejected": rejected})
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def write_preferences(seed: int, world: list[Country], facts: dict[str, list[Fact]], directory: Path) -> dict[str, int]:
    """Write the preference set under ``directory`` as JSON lines and parquet; its pair counts."""
    counts = {}
    schema = pa.schema([(k, pa.string()) for k in COLUMNS])
    for split, rows in make_preferences(seed, world, facts).items():
        write_parquet(directory / f"preference_{split}.parquet", pa.table({k: [r[k] for r in rows] for k in COLUMNS}, schema=schema))
        write_jsonl(directory / f"preference_{split}.jsonl", rows)
        counts[f"preference_{split}"] = len(rows)
    return counts
