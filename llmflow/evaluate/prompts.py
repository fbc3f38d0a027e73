"""Multiple-choice prompts exactly as lm-evaluation-harness builds them for its ``mmlu``,
``ceval-valid`` and ``cmmlu`` tasks.

A prompt is the task's description, then the first ``shots`` dev questions of the subject,
each followed by the target delimiter " ", its answer letter and "\\n\\n", then the question.
A question is its text (stripped), "\\nA. ..." to "\\nD. ..." and the answer prompt: "Answer:"
for MMLU, "答案：" for C-Eval and CMMLU. The continuations scored are " A", " B", " C", " D":
lm-evaluation-harness's default target delimiter is a space, and none of these tasks sets
another. Under a chat template (``chat_context``) the description is the system message and the
letters are scored without the space, as in the harness.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from llmflow.evaluate.chat_context import PLAIN_PROMPTS, TARGET_DELIMITER, Example, PromptRenderer
from llmflow.evaluate.questions import LETTERS, Question
from llmflow.evaluate.subjects_zh import CEVAL_SUBJECTS, CMMLU_SUBJECTS

CONTINUATIONS = tuple(TARGET_DELIMITER + letter for letter in LETTERS)


def continuations(renderer: PromptRenderer) -> tuple[str, ...]:
    """The four answers scored after the prompt: ``CONTINUATIONS``, or the bare letters under a
    chat template (the harness drops the target delimiter there)."""
    return tuple(renderer.continuation_delimiter(TARGET_DELIMITER) + letter for letter in LETTERS)


@dataclass(frozen=True)
class PromptFormat:
    """How one benchmark words its prompts."""

    description: str
    """The task description before the examples, with ``{subject}`` for the subject's name."""
    answer_prompt: str
    """What ends each question, before the answer letter."""
    subject_names: Mapping[str, str] = field(default_factory=dict)
    """Subject -> its name in the description; other subjects are named by their identifier
    with underscores as spaces."""

    def describe(self, subject: str) -> str:
        """The description of ``subject``'s prompts."""
        return self.description.format(subject=self.subject_names.get(subject) or " ".join(subject.split("_")))

    def question_text(self, q: Question) -> str:
        """lm-evaluation-harness's doc_to_text: the question and its choices, ending in the answer prompt."""
        choices = "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices))
        return f"{q.question.strip()}{choices}\n{self.answer_prompt}"

    def solved_example(self, q: Question) -> str:
        """A few-shot example in plain text: the question, the target delimiter and its answer letter."""
        return self.question_text(q) + TARGET_DELIMITER + LETTERS[q.answer]

    def build_prompt(self, q: Question, dev: list[Question], shots: int, renderer: PromptRenderer = PLAIN_PROMPTS) -> str:
        """The prompt of ``q`` with the first ``shots`` questions of ``dev`` as examples, rendered
        under the run's chat settings."""
        if shots > len(dev):
            raise ValueError(f"subject {q.subject}: {shots} shots asked for, the dev split has {len(dev)} questions")
        examples = [Example(self.question_text(d), LETTERS[d.answer]) for d in dev[:shots]]
        return renderer.prompt(self.describe(q.subject), examples, self.question_text(q), f"subject {q.subject}")


MMLU_PROMPT = PromptFormat("The following are multiple choice questions (with answers) about {subject}.\n\n", "Answer:")
CEVAL_PROMPT = PromptFormat(
    "以下是中国关于{subject}的单项选择题，请选出其中的正确答案。\n\n", "答案：",
    {subject: name for subject, (name, _) in CEVAL_SUBJECTS.items()},
)
CMMLU_PROMPT = PromptFormat(
    "以下是关于{subject}的单项选择题，请直接给出正确答案的选项。\n\n", "答案：",
    {subject: name for subject, (name, _) in CMMLU_SUBJECTS.items()},
)
