"""Next-token prediction (pretraining and instruction data): the mean cross-entropy over every
target token of the global batch."""

from __future__ import annotations

from typing import Any

import torch

from llmflow.models.pipeline import ScaledLoss
from llmflow.train.config import TrainConfig
from llmflow.train.data import BlendedSamples, PretrainSamples
from llmflow.train.objectives.base import Objective, instruction_samples
from llmflow.train.run import Batch, Run, all_reduce_over, rank_sum_scale


class NextToken(Objective):
    """Cross-entropy of every target token: each micro-batch's summed loss over the global
    batch's target tokens."""

    def __init__(self) -> None:
        self.scale = 1.0
        """This step's factor of a micro-batch's summed loss (``rank_sum_scale`` / target tokens)."""

    def samples(self, config: TrainConfig) -> Any:
        d = config.data
        if d.kind == "sft":
            return instruction_samples(config)
        if config.seq_length is None:
            raise ValueError("seq_length is required for pretraining")
        parts = [PretrainSamples(p, config.seq_length, config.seed + i, d.document_attention)
                 for i, p in enumerate(d.paths)]
        if len(parts) == 1:
            return parts[0]
        return BlendedSamples(parts, d.weights or [1.0] * len(parts), config.steps * config.global_batch_size)

    def begin_step(self, run: Run, batches: list[Batch]) -> float:
        count = torch.tensor(float(sum(int((b["targets"] != -100).sum()) for b in batches)), device=run.env.device)
        total = max(all_reduce_over(count, run.topo.dp_group).item(), 1.0)
        self.scale = rank_sum_scale(run) / total
        return total

    def micro_loss(self, run: Run, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return output * self.scale, output

    def pipeline_loss(self, run: Run) -> ScaledLoss:
        return ScaledLoss()

    def begin_pipeline_step(self, run: Run, batches: list[Batch]) -> None:
        run.pipeline_loss.scale = self.scale
