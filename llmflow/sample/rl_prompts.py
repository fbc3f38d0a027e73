"""The sample's prompt set for online reinforcement learning, in the plain prompt layout
(prompt, answer): every fact of the world asked as a question (a country's capital, the
country of a capital, its national animal, its flag's colour, a sum), its answer the fact's
(a name, a word, or a number written as a string), scored by the ``qa_match`` reward (and a
sum's also by ``gsm8k_flexible``).

- ``rl/rl_train.{jsonl,parquet}``: each fact asked in the preference set's three training
  wordings (144 prompts for the default 8 countries);
- ``rl/rl_heldout.{jsonl,parquet}``: the same facts asked in its two held-out wordings (96
  prompts), so that what reinforcement learning on the training wordings teaches shows on
  prompts that differ from them only in how the question is worded.

The rows come in an order drawn from a random stream of their own, so adding them leaves
every other sample file as it was.
"""

from __future__ import annotations

import random
from pathlib import Path

from llmflow.sample.parquet import write_jsonl, write_rows
from llmflow.sample.preferences import KINDS, TRAIN_WORDINGS, questions
from llmflow.sample.world import Country, Fact


def make_rl_prompts(seed: int, world: list[Country], facts: dict[str, list[Fact]]) -> dict[str, list[dict[str, str]]]:
    """The ``train`` and ``heldout`` prompts, each split in random order."""
    rng = random.Random(f"{seed}-rl-prompts")
    splits: dict[str, list[dict[str, str]]] = {"train": [], "heldout": []}
    for kind, fields, answer, _ in questions(world, facts):
        for i, wording in enumerate(KINDS[kind][1]):
            splits["train" if i < TRAIN_WORDINGS else "heldout"].append({"prompt": wording.format(**fields),
                                                                          "answer": answer})
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def write_rl_prompts(seed: int, world: list[Country], facts: dict[str, list[Fact]], directory: Path) -> dict[str, int]:
    """Write the prompt set under ``directory`` as JSON lines and parquet; its prompt counts."""
    counts = {}
    for split, rows in make_rl_prompts(seed, world, facts).items():
        write_rows(directory / f"rl_{split}.parquet", rows)
        write_jsonl(directory / f"rl_{split}.jsonl", rows)
        counts[f"rl_{split}"] = len(rows)
    return counts
