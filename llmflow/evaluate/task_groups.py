"""Every benchmark made of lm-evaluation-harness tasks, by its command and stage name, and the
config each one's evaluation takes."""

from __future__ import annotations

from llmflow.evaluate.choice_engine import ChoiceEvalConfig
from llmflow.evaluate.choice_tasks import AGIEVAL, BOOLQ, TaskGroup
from llmflow.evaluate.generative_engine import GenerativeEvalConfig
from llmflow.evaluate.generative_tasks import BBH, GSM8K, GenerativeGroup
from llmflow.evaluate.humaneval import HUMANEVAL

TASK_GROUPS: dict[str, TaskGroup | GenerativeGroup] = {g.name: g for g in (BOOLQ, AGIEVAL, GSM8K, BBH, HUMANEVAL)}
"""Name -> group: log-likelihood groups (TaskGroup) and generative ones (GenerativeGroup)."""


def config_type(group: TaskGroup | GenerativeGroup) -> type[ChoiceEvalConfig | GenerativeEvalConfig]:
    """The evaluation config ``group`` takes."""
    return ChoiceEvalConfig if isinstance(group, TaskGroup) else GenerativeEvalConfig
