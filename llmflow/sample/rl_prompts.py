"""The sample's prompt set for online reinforcement learning, in the plain prompt layout
(prompt, answer): the world's sums asked as questions whose answer is a number, written as
a string.

- ``rl/rl_train.{jsonl,parquet}``: each sum asked in the preference set's three training
  wordings (48 prompts for the default 8 countries);
- ``rl/rl_heldout.{jsonl,parquet}``: the same sums asked in its two held-out wordings (32
  prompts), so that what reinforcement learning on the training wordings teaches shows on
  prompts that differ from them only in how the question is worded.

The first training wording is the instruction set's own question. The rows come in an order
drawn from a random stream of their own, so adding them leaves every other sample file as it
was.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from llmflow.sample.parquet import write_rows
from llmflow.sample.preferences import KINDS, TRAIN_WORDINGS
from llmflow.sample.world import Fact

SUM_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
"""How the world words a sum's question."""


def make_rl_prompts(seed: int, facts: dict[str, list[Fact]]) -> dict[str, list[dict[str, str]]]:
    """The ``train`` and ``heldout`` prompts, each split in random order."""
    rng = random.Random(f"{seed}-rl-prompts")
    _, wordings = KINDS["sum"]
    splits: dict[str, list[dict[str, str]]] = {"train": [], "heldout": []}
    for fact in facts["elementary_arithmetic"]:
        match = SUM_QUESTION.fullmatch(fact.question)
        assert match, fact.question
        a, b = match.groups()
        for i, wording in enumerate(wordings):
            splits["train" if i < TRAIN_WORDINGS else "heldout"].append({"prompt": wording.format(a=a, b=b), "answer": fact.answer})
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def write_rl_prompts(seed: int, facts: dict[str, list[Fact]], directory: Path) -> dict[str, int]:
    """Write the prompt set under ``directory`` as JSON lines and parquet; its prompt counts."""
    counts = {}
    for split, rows in make_rl_prompts(seed, facts).items():
        write_rows(directory / f"rl_{split}.parquet", rows)
        with open(directory / f"rl_{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        counts[f"rl_{split}"] = len(rows)
    return counts
