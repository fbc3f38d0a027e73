"""Where a LoRA adapter on the routed experts (``models/lora.py``'s ``ExpertLora``, PEFT's
``target_parameters``) goes into an experts module's stacked weights: each experts module
names, for each of its weights, its part of the transformers weight an adapter updates
(``LORA_PARTS``), and adds the active adapters' updates as it computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertAdapterPart:
    """Where an experts module's stacked weight [experts, ...] sits in the transformers weight an
    expert adapter updates (``target``): the ``part``-th of ``parts`` equal blocks of its rows
    (output features), stored as [out, in] per expert, or [in, out] when ``transposed``."""

    target: str
    part: int = 0
    parts: int = 1
    transposed: bool = False

    def of(self, delta: torch.Tensor) -> torch.Tensor:
        """This weight's share of ``delta`` [experts, out, in], in its own layout."""
        piece = delta.chunk(self.parts, dim=1)[self.part]
        return piece.transpose(1, 2) if self.transposed else piece

    def features(self, shape: torch.Size) -> tuple[int, int]:
        """(in, out) of this weight's part, from its shape [experts, ., .]."""
        first, second = shape[1], shape[2]
        return (first, second) if self.transposed else (second, first)


def expert_deltas(experts: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The update of each active adapter of an experts module (``lora``), by target."""
    adapters = getattr(experts, "lora", None)
    if adapters is None:
        return {}
    return {target: adapter.delta(dtype) for target, adapter in adapters.items() if adapter.active}


def adapted_expert_weight(experts: nn.Module, name: str, weight: torch.Tensor,
                          deltas: dict[str, torch.Tensor]) -> torch.Tensor:
    """``weight`` (the compute-dtype local experts of ``experts``' parameter ``name``) with its
    share of the adapters' ``deltas`` added."""
    part = experts.LORA_PARTS[name]
    return weight + part.of(deltas[part.target]) if part.target in deltas else weight
