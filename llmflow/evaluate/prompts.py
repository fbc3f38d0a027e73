"""MMLU prompts exactly as lm-evaluation-harness's default ``mmlu`` task builds them.

description "The following are multiple choice questions (with answers) about {subject}.\\n\\n"
(underscores of the subject as spaces), then the first ``shots`` dev questions of the subject
each followed by " {letter}" and "\\n\\n", then the question, ending in "Answer:". The
continuations scored are " A", " B", " C", " D".
"""

from __future__ import annotations

from llmflow.data.templates import ChatTemplate
from llmflow.evaluate.mmlu_data import LETTERS, Question

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
CONTINUATIONS = tuple(TARGET_DELIMITER + letter for letter in LETTERS)


def description(subject: str) -> str:
    """The task description lm-evaluation-harness puts before the examples."""
    return f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"


def question_text(q: Question) -> str:
    """lm-evaluation-harness's doc_to_text: the question and its choices, ending in "Answer:"."""
    choices = "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices))
    return f"{q.question.strip()}{choices}\nAnswer:"


def solved_example(q: Question) -> str:
    """A few-shot example: the question, the target delimiter and its answer letter."""
    return question_text(q) + TARGET_DELIMITER + LETTERS[q.answer]


def build_prompt(q: Question, dev: list[Question], shots: int) -> str:
    """The plain-text prompt of ``q`` with the first ``shots`` questions of ``dev`` as examples."""
    if shots > len(dev):
        raise ValueError(f"subject {q.subject}: {shots} shots asked for, the dev split has {len(dev)} questions")
    examples = "".join(solved_example(d) + FEWSHOT_DELIMITER for d in dev[:shots])
    return description(q.subject) + examples + question_text(q)


def chat_prompt(prompt: str, template: ChatTemplate) -> str:
    """``prompt`` as the user message of a conversation, followed by the assistant's turn header."""
    return template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
