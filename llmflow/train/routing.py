"""The mixture-of-experts side of a training step: the load-balancing auxiliary loss added
to each micro-batch's objective (and DeepSeek-V3's sequence-wise one, when trained), the
auxiliary-loss-free update of the routers' correction biases after each optimizer step, and
the routing statistics logged with the step's metrics (per-expert token counts, and the most
loaded expert of any layer, so that expert collapse shows in MLflow while it happens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmflow.models.blocks.moe import load_balancing_loss, moe_layers, sequence_balancing_loss
from llmflow.models.blocks.moe_routing import corrected_bias
from llmflow.models.config import text_config


def aux_loss_coefficient(override: float | None, hf_config: dict[str, Any]) -> float:
    """The weight of the auxiliary loss in the training loss: ``override`` when given, else as
    transformers trains the checkpoint: its ``router_aux_loss_coef`` when its config.json sets
    ``output_router_logits`` (a multimodal config.json: its text config), 0 otherwise."""
    if override is not None:
        return override
    text = text_config(hf_config)
    return float(text.get("router_aux_loss_coef", 0.0)) if text.get("output_router_logits") else 0.0


@dataclass(frozen=True)
class SequenceLoss:
    """DeepSeek-V3's sequence-wise auxiliary loss, as trained."""

    coef: float
    """Its weight in the training loss."""
    dp_group: Any
    """The ranks holding other sequences of the micro-batch."""
    shard_groups: tuple[Any, ...]
    """The groups whose ranks hold pieces of the same sequences (context and tensor parallel)."""


class RoutingLog:
    """The routing of one optimizer step on this rank, micro-batch by micro-batch."""

    def __init__(self, parts: list[torch.nn.Module], dp_group: dist.ProcessGroup | None, aux_loss_coef: float = 0.0,
                 sequence_loss: SequenceLoss | None = None) -> None:
        """``dp_group``: the ranks that share a micro-batch's tokens; ``aux_loss_coef``: the
        weight of the load-balancing loss; ``sequence_loss``: the sequence-wise loss trained."""
        self.blocks = [block for part in parts for _, block in moe_layers(part)]
        self.dp_group = dp_group
        self.aux_loss_coef = aux_loss_coef
        self.sequence_loss = sequence_loss
        for block in self.blocks:
            block.keep_probabilities = sequence_loss is not None
        self.reset()

    def reset(self) -> None:
        self.assignments: torch.Tensor | None = None  # [moe layers, experts]
        self.aux_sum = torch.zeros(())
        self.seq_aux_sum = torch.zeros(())
        self.forwards = 0
        self._totals: torch.Tensor | None = None

    def after_forward(self) -> torch.Tensor | None:
        """This rank's share of the weighted auxiliary losses of the micro-batch that just ran,
        over every dp rank's slice of it (with its gradient; None when no auxiliary loss is
        trained or the model has no experts); its routing added to the step's."""
        aux = load_balancing_loss(self.blocks, self.dp_group)
        if aux is None:
            return None
        counts = torch.stack([block.routing.tokens_per_expert for block in self.blocks])
        self.assignments = counts if self.assignments is None else self.assignments + counts
        self.aux_sum = self.aux_sum.to(aux.device) + aux.detach().float()
        self.forwards += 1
        trained = [self.aux_loss_coef * aux] if self.aux_loss_coef else []
        if self.sequence_loss is not None:
            loss = self.sequence_loss
            seq_aux = sequence_balancing_loss(self.blocks, loss.shard_groups, loss.dp_group)
            self.seq_aux_sum = self.seq_aux_sum.to(seq_aux.device) + seq_aux.detach().float()
            for block in self.blocks:  # taken: the next forward keeps its own
                block.routing.probabilities = None
            trained.append(loss.coef * seq_aux)
        return sum(trained[1:], trained[0]) if trained else None

    def totals(self) -> torch.Tensor:
        """The step's assignments [moe layers, experts] and the sum of its auxiliary losses'
        shares (the load-balancing loss's, then the sequence-wise loss's) as one fp32 vector,
        summed over every dp rank (a collective, run once per step)."""
        if self._totals is None:
            self._totals = torch.cat([self.assignments.flatten().float(), self.aux_sum.reshape(1),
                                      self.seq_aux_sum.to(self.aux_sum.device).reshape(1)])
            if self.dp_group is not None:
                dist.all_reduce(self._totals, group=self.dp_group)
        return self._totals

    @torch.no_grad()
    def update_biases(self, rate: float) -> None:
        """Auxiliary-loss-free balancing after the optimizer step: each layer's correction
        bias moved by ``rate`` towards balance (``corrected_bias``), from the loads of the
        step's micro-batches on every rank, so every rank moves its copy alike."""
        if self.assignments is None:
            return
        loads = self.totals()[:-2].view_as(self.assignments)
        for block, load in zip(self.blocks, loads, strict=True):
            bias = block.gate.e_score_correction_bias
            bias.copy_(corrected_bias(bias, load.to(bias.device), rate))

    def metrics(self) -> dict[str, float]:
        """``moe_aux_loss`` (the step's mean over micro-batches), ``moe_seq_aux_loss`` (the
        sequence-wise loss's, when trained), ``moe_max_expert_load`` (the largest share of a
        layer's assignments one expert took, times the number of experts: 1.0 is perfect
        balance, experts / top-k total collapse) and ``expert_tokens/{e}`` (assignments per
        expert, all layers), over every dp rank's tokens (a collective)."""
        if self.assignments is None:
            return {}
        totals = self.totals()
        counts = totals[:-2].view_as(self.assignments)
        experts = counts.shape[1]
        shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        per_expert = counts.sum(dim=0).tolist()
        seq = {"moe_seq_aux_loss": (totals[-1] / self.forwards).item()} if self.sequence_loss is not None else {}
        return {"moe_aux_loss": (totals[-2] / self.forwards).item(), **seq,
                "moe_max_expert_load": (shares.max() * experts).item(),
                **{f"expert_tokens/{e}": value for e, value in enumerate(per_expert)}}
