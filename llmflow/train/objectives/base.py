"""What a training method adds to the loop: the interface every objective implements.

A step of ``llmflow.train.loop.train_step`` asks its objective for this rank's micro-batches
(``micro_batches``), lets it all-reduce what its loss is normalised by (``begin_step``), runs
the model on every micro-batch and hands the output to ``micro_loss`` (the micro-batch's share
of the step's objective, already normalised, and its share of the reported loss), then
collects the step's metrics (``end_step``). Under pipeline parallelism the last stage calls the
objective's ``pipeline_loss`` instead, prepared for each step by ``begin_pipeline_step``.

The loss of a step is the same function of the global batch on any layout: an objective
normalises by counts over the whole global batch (all-reduced in ``begin_step``), and each
rank's share is multiplied by ``rank_sum_scale`` where FSDP averages gradients over ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from llmflow.data.instruction_dataset import InstructionDataset
from llmflow.models import ModelConfig
from llmflow.train.config import TrainConfig
from llmflow.train.data import check_token_ids, collate
from llmflow.train.run import Batch, Run


class Objective:
    """One training method's part of every step (the default methods read samples of a
    dataset addressed by global index; see ``micro_batches``)."""

    token_losses: bool = False
    """Whether the model gives every token's loss (``loss_reduction="none"``) rather than
    their sum."""
    loss_over_cp: bool = True
    """Whether each cp rank holds a share of the reported loss (summed over cp), rather than
    the whole of it."""

    def samples(self, config: TrainConfig) -> Any:
        """The run's data, addressed by global sample index."""
        raise NotImplementedError

    def problems(self, config: TrainConfig, layout: Any, model: ModelConfig | None) -> list[str]:
        """Why this objective cannot train ``config`` in ``layout`` on ``model`` (None when its
        config cannot be read; checked before the model loads)."""
        return []

    def prepare(self, run: Run) -> None:
        """Anything the objective needs once the model is loaded and before the run resumes
        (the initial weights are then the model's)."""

    def model_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of the model's forward."""
        return {}

    def micro_batches(self, run: Run, step: int) -> list[Batch]:
        """This rank's micro-batches of ``step``: its data-parallel slice of each of the global
        batch's (whole sequences: the ranks of a context-parallel group read the same samples)."""
        config = run.config
        per_step = config.micro_batch_size * run.topo.layout.dp
        first = (step - 1) * config.global_batch_size
        batches = []
        for m in range(run.accumulation):
            base = first + m * per_step + run.topo.dp_rank * config.micro_batch_size
            samples = [run.samples[base + j] for j in range(config.micro_batch_size)]
            check_token_ids(samples, run.vocab_size)
            batches.append(self.batch(collate(samples)))
        return batches

    def batch(self, batch: Batch) -> Batch:
        """A collated micro-batch as the model is given it."""
        return batch

    def begin_step(self, run: Run, batches: list[Batch]) -> float:
        """Count what the step's objective is normalised by over the global batch (this rank's
        ``batches``, all-reduced over dp); returns the number the reported loss sum is divided by."""
        raise NotImplementedError

    def micro_loss(self, run: Run, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """From the model's ``output`` on ``batch``: what backward runs on (this micro-batch's
        share of the step's objective, times ``rank_sum_scale``) and its share of the reported loss."""
        raise NotImplementedError

    def pipeline_loss(self, run: Run) -> Any:
        """The pipeline schedule's loss function (pp > 1)."""
        raise NotImplementedError

    def begin_pipeline_step(self, run: Run, batches: list[Batch]) -> None:
        """Prepare ``run.pipeline_loss`` for the step's ``batches``."""

    def end_step(self, run: Run) -> dict[str, float]:
        """The step's metrics beside its loss (all-reduced as they need)."""
        return {}

    def step_line(self, metrics: dict[str, float]) -> str:
        """What the step's line printed to stdout adds after the loss and throughput."""
        return ""

    def close(self) -> None:
        """Release what ``prepare`` started (worker processes) at the end of the run."""


def instruction_samples(config: TrainConfig, dataset: type[InstructionDataset] = InstructionDataset) -> Any:
    """The rows of ``config``'s one tokenized dataset, shuffled per epoch."""
    from llmflow.train.data import SftSamples

    return SftSamples(config.data.paths[0], config.seed, dataset)
