"""The mixture-of-experts side of a training step: the load-balancing auxiliary loss added
to each micro-batch's objective, and the routing statistics logged with the step's metrics
(per-expert token counts, and the most loaded expert of any layer, so that expert collapse
shows in MLflow while it happens)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from llmflow.models.blocks.moe import load_balancing_loss, moe_layers
from llmflow.models.config import text_config


def aux_loss_coefficient(override: float | None, hf_config: dict[str, Any]) -> float:
    """The weight of the auxiliary loss in the training loss: ``override`` when given, else as
    transformers trains the checkpoint: its ``router_aux_loss_coef`` when its config.json sets
    ``output_router_logits`` (a multimodal config.json: its text config), 0 otherwise."""
    if override is not None:
        return override
    text = text_config(hf_config)
    return float(text.get("router_aux_loss_coef", 0.0)) if text.get("output_router_logits") else 0.0


class RoutingLog:
    """The routing of one optimizer step on this rank, micro-batch by micro-batch."""

    def __init__(self, parts: list[torch.nn.Module], dp_group: dist.ProcessGroup | None) -> None:
        self.blocks = [block for part in parts for _, block in moe_layers(part)]
        self.dp_group = dp_group
        self.reset()

    def reset(self) -> None:
        self.assignments: torch.Tensor | None = None  # [moe layers, experts]
        self.aux_sum = torch.zeros(())
        self.forwards = 0

    def after_forward(self) -> torch.Tensor | None:
        """This rank's share of the auxiliary loss of the micro-batch that just ran, over every
        dp rank's slice of it (with its gradient); its routing added to the step's. None for a
        model without experts."""
        aux = load_balancing_loss(self.blocks, self.dp_group)
        if aux is None:
            return None
        counts = torch.stack([block.routing.tokens_per_expert for block in self.blocks])
        self.assignments = counts if self.assignments is None else self.assignments + counts
        self.aux_sum = self.aux_sum.to(aux.device) + aux.detach().float()
        self.forwards += 1
        return aux

    def metrics(self) -> dict[str, float]:
        """``moe_aux_loss`` (the step's mean over micro-batches), ``moe_max_expert_load`` (the
        largest share of a layer's assignments one expert took, times the number of experts:
        1.0 is perfect balance, experts / top-k total collapse) and ``expert_tokens/{e}``
        (assignments per expert, all layers), over every dp rank's tokens (a collective)."""
        if self.assignments is None:
            return {}
        totals = torch.cat([self.assignments.flatten().float(), self.aux_sum.reshape(1)])
        if self.dp_group is not None:
            dist.all_reduce(totals, group=self.dp_group)
        counts = totals[:-1].view_as(self.assignments)
        experts = counts.shape[1]
        shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        per_expert = counts.sum(dim=0).tolist()
        return {"moe_aux_loss": (totals[-1] / self.forwards).item(),
                "moe_max_expert_load": (shares.max() * experts).item(),
                **{f"expert_tokens/{e}": value for e, value in enumerate(per_expert)}}
