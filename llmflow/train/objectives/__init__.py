"""The training objectives, one module each, registered by ``TrainConfig.method``: the loop
runs any of them through the ``Objective`` interface (``base.py``)."""

from __future__ import annotations

from llmflow.train.objectives.base import Objective
from llmflow.train.objectives.grpo import Grpo
from llmflow.train.objectives.next_token import NextToken
from llmflow.train.objectives.preference import Preference

OBJECTIVES: dict[str, type[Objective]] = {
    "next_token": NextToken,
    "dpo": Preference,
    "simpo": Preference,
    "orpo": Preference,
    "grpo": Grpo,
}


def objective_for(method: str) -> Objective:
    """A fresh objective of training ``method``."""
    try:
        return OBJECTIVES[method]()
    except KeyError:
        raise ValueError(f"method {method!r}: expected one of {', '.join(OBJECTIVES)}") from None
