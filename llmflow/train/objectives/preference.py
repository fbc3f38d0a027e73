"""Preference objectives (DPO, SimPO, ORPO) on chosen/rejected pairs: the loop's side of
``llmflow.train.pairs`` (a micro-batch's pairs and objective) and ``llmflow.train.preference``
(the per-pair math), with DPO's reference log-probs computed before the first step."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmflow.data.preference_dataset import PreferenceDataset
from llmflow.train.config import TrainConfig
from llmflow.train.data import check_token_ids, collate
from llmflow.train.objectives.base import Objective, instruction_samples
from llmflow.train.pairs import (
    STATS,
    PairCounts,
    PipelinePairLoss,
    document_totals,
    pair_batch,
    pair_counts,
    pair_objective,
    reference_pairs,
    sequence_targets,
    step_metrics,
)
from llmflow.train.reference import gather_rows, load_reference, reference_dir, save_reference, stack_rows
from llmflow.train.run import Batch, Run, all_reduce_over, held, model_inputs, pipeline_run, rank_sum_scale


class Preference(Objective):
    """dpo, simpo or orpo (``config.method``) with ``config.preference``'s settings: the mean
    over the global batch's pairs of each pair's loss (ORPO adds its chosen sequences' NLL)."""

    token_losses = True
    loss_over_cp = False  # the objective is of whole sequences: every cp rank holds all of it

    def __init__(self) -> None:
        self.reference: np.ndarray | None = None
        """dpo: the reference model's log-probs of every row's pairs [rows, pairs, 2]."""
        self.counts: PairCounts | None = None
        """The current step's pairs and chosen tokens (the objective's normalisers)."""
        self.stats: list[torch.Tensor] = []
        """The current step's metric sums, one per micro-batch (``pair_objective``)."""

    def samples(self, config: TrainConfig) -> Any:
        return instruction_samples(config, PreferenceDataset)

    def prepare(self, run: Run) -> None:
        if run.config.method == "dpo":  # before resuming: the initial weights are the reference
            self.reference = reference_logps(run)

    def batch(self, batch: Batch) -> Batch:
        """``batch`` with the next token of every position of each packed sequence as
        ``sequence_targets``: what the model is given under a preference objective."""
        return batch | {"sequence_targets": sequence_targets(batch["input_ids"], batch["document_ids"])}

    def begin_step(self, run: Run, batches: list[Batch]) -> float:
        count = all_reduce_over(pair_counts(batches).to(run.env.device), run.topo.dp_group)
        self.counts, self.stats = PairCounts(*count.tolist()), []
        return 1.0  # the objective comes normalised by the step's pairs (and chosen tokens)

    def micro_loss(self, run: Run, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        config = run.config
        loss, stats = pair_objective(output, pair_batch(batch, held(run, batch), self.reference, run.env.device),
                                     config.method, config.preference, self.counts, run.topo.cp_group)
        self.stats.append(stats)
        return loss * rank_sum_scale(run), loss

    def pipeline_loss(self, run: Run) -> PipelinePairLoss:
        return PipelinePairLoss(run.config.method, run.config.preference, run.topo.cp_group)

    def begin_pipeline_step(self, run: Run, batches: list[Batch]) -> None:
        loss = run.pipeline_loss
        loss.queue = [pair_batch(b, held(run, b), self.reference, run.env.device) for b in batches]
        loss.counts, loss.stats, loss.scale = self.counts, self.stats, rank_sum_scale(run)

    def end_step(self, run: Run) -> dict[str, float]:
        stats = torch.stack(self.stats).sum(0) if self.stats else torch.zeros(STATS, device=run.env.device)
        all_reduce_over(stats, run.topo.pp_group, run.topo.dp_group)
        return step_metrics(stats, self.counts.pairs)

    def step_line(self, metrics: dict[str, float]) -> str:
        return (f" | reward_accuracy {metrics['rewards/accuracies']:.3f} | "
                f"reward_margin {metrics['rewards/margins']:.4f}")


def reference_logps(run: Run) -> np.ndarray:
    """The reference log-probs of the run's pairs: the cached ones when their inputs are
    this run's, else computed now with the model's current (initial) weights and cached."""
    cached = load_reference(run.config, run.dtype)
    if cached is not None:
        if run.env.is_main:
            print(f"reference log-probs from {reference_dir(run.config)}", flush=True)
        return cached
    computed = compute_reference(run)
    if run.env.is_main:
        print(f"reference log-probs of {computed.shape[0]} rows saved in "
              f"{save_reference(run.config, run.dtype, computed)}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return computed


@torch.no_grad()
def compute_reference(run: Run) -> np.ndarray:
    """Every dataset row's (chosen, rejected) log-probs under the model as it is, the rows
    split over the data-parallel ranks as training splits them (a global batch at a time)."""
    config, samples = run.config, run.samples
    rows: dict[int, np.ndarray] = {}
    per_rank = config.micro_batch_size
    for first in range(0, samples.num_samples, config.global_batch_size):
        batches = []
        for m in range(run.accumulation):
            base = first + (m * run.topo.layout.dp + run.topo.dp_rank) * per_rank
            batch_samples = [samples.row((base + j) % samples.num_samples) for j in range(per_rank)]
            check_token_ids(batch_samples, run.vocab_size)
            batches.append(run.objective.batch(collate(batch_samples)))
        for batch, totals in zip(batches, forward_totals(run, batches), strict=True):
            if totals is not None:
                rows.update(zip(batch["rows"].tolist(), reference_pairs(totals), strict=True))
    return stack_rows(gather_rows(rows), samples.num_samples)


def forward_totals(run: Run, batches: list[Batch]) -> list[torch.Tensor | None]:
    """Each micro-batch's ``document_totals`` (None on the ranks of earlier pipeline stages)."""
    device = run.env.device
    if run.pipeline is None:
        totals = []
        for batch in batches:
            nll = run.parts[0](**model_inputs(run, batch), loss_reduction="none")
            totals.append(document_totals(nll, pair_batch(batch, held(run, batch), None, device), run.topo.cp_group))
        return totals
    loss = run.pipeline_loss
    loss.queue, loss.counts, loss.totals = [pair_batch(b, held(run, b), None, device) for b in batches], None, []
    pipeline_run(run, batches, run.pipeline.eval)
    return loss.totals or [None] * len(batches)
