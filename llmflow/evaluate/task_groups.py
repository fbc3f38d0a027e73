"""Every benchmark made of lm-evaluation-harness tasks, by its command and stage name, and the
config each one's evaluation takes."""

from __future__ import annotations

from llmflow.evaluate.choice_engine import ChoiceEvalConfig
from llmflow.evaluate.choice_tasks import AGIEVAL, BOOLQ, TaskGroup
from llmflow.evaluate.generative_engine import GenerativeEvalConfig
from llmflow.evaluate.generative_tasks import BBH, GSM8K, GenerativeGroup
from llmflow.evaluate.gpqa import GPQA_DIAMOND
from llmflow.evaluate.humaneval import HUMANEVAL
from llmflow.evaluate.ifeval import IFEVAL
from llmflow.evaluate.minerva_math import MINERVA_MATH, MINERVA_MATH500
from llmflow.evaluate.mmlu_pro import MMLU_PRO

TASK_GROUPS: dict[str, TaskGroup | GenerativeGroup] = {
    g.name: g for g in (BOOLQ, AGIEVAL, GSM8K, BBH, HUMANEVAL, MINERVA_MATH500, MINERVA_MATH, MMLU_PRO, GPQA_DIAMOND,
                        IFEVAL)}
"""Name -> group: log-likelihood groups (TaskGroup) and generative ones (GenerativeGroup)."""


def config_type(group: TaskGroup | GenerativeGroup) -> type[ChoiceEvalConfig | GenerativeEvalConfig]:
    """The evaluation config ``group`` takes."""
    return ChoiceEvalConfig if isinstance(group, TaskGroup) else GenerativeEvalConfig
