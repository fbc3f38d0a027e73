"""The sample's instruction set (Alpaca layout: instruction, input, output): plain questions
about the world's facts answered in a sentence, and practice quizzes in the MMLU prompt format."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa

from llmflow.evaluate.chat_context import FEWSHOT_DELIMITER
from llmflow.evaluate.prompts import MMLU_PROMPT
from llmflow.evaluate.questions import Question
from llmflow.sample.mmlu import new_question
from llmflow.sample.parquet import write_jsonl, write_parquet
from llmflow.sample.world import Fact

QUIZ_MAX = 5


def plain_row(fact: Fact, rng: random.Random) -> dict[str, str]:
    """A question about ``fact`` answered with the sentence that states it."""
    if rng.random() < 0.5:
        return {"instruction": fact.question, "input": "", "output": fact.statement}
    return {"instruction": "Answer the question in one sentence.", "input": fact.question, "output": fact.statement}


def quiz_row(questions: list[Question]) -> dict[str, str]:
    """Practice questions of one subject answered in the MMLU prompt format: the
    instruction is the prompt's first line, the output the solved questions."""
    return {
        "instruction": MMLU_PROMPT.describe(questions[0].subject).strip(),
        "input": "",
        "output": FEWSHOT_DELIMITER.join(MMLU_PROMPT.solved_example(q) for q in questions),
    }


def make_instructions(
    rng: random.Random, facts: dict[str, list[Fact]], mmlu: dict[str, dict[str, list[Question]]], rows: int
) -> list[dict[str, str]]:
    """One plain question per fact, then practice quizzes of one to five questions of one
    subject, in random order; practice questions avoid the MMLU questions."""
    all_facts = [f for subject_facts in facts.values() for f in subject_facts]
    taken = {q for splits in mmlu.values() for split in splits.values() for q in split}
    out = [plain_row(f, rng) for f in rng.sample(all_facts, len(all_facts))][:rows]
    subjects = sorted(facts)
    while len(out) < rows:
        subject_facts = facts[rng.choice(subjects)]
        chosen = rng.sample(subject_facts, min(rng.randint(1, QUIZ_MAX), len(subject_facts)))
        out.append(quiz_row([new_question(f, rng, taken) for f in chosen]))
    rng.shuffle(out)
    return out

def write_instructions(rows: list[dict[str, str]], directory: Path) -> None:
    """The instruction set as parquet and as JSON lines."""
    columns = {key: [r[key] for r in rows] for key in ("instruction", "input", "output")}
    schema = pa.schema([(k, pa.string()) for k in columns])
    write_parquet(directory / "alpaca.parquet", pa.table(columns, schema=schema))
    write_jsonl(directory / "alpaca.jsonl", rows)
