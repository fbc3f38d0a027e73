"""The preference objective of a training step, over ranks: a micro-batch's pairs on this
rank, their reference log-probs, and the objective and metrics from the model's per-token
losses (``llmflow.train.preference`` holds the per-pair math).

The model is given every next-token target of each packed sequence (prompt positions too,
which ORPO's supervised term reads); the response tokens, where the tokenized targets are
not -100, make the pairs' log-probs. Under context parallelism every rank holds part of
each sequence: the per-document sums are added up over the cp group (the backward passes
each rank the whole sum's gradient, for its own tokens), so every cp rank computes the
same objective of whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from llmflow.data.instruction_dataset import next_token_targets
from llmflow.train.preference import (
    PairLogps,
    PreferenceConfig,
    document_sums,
    nll_weight,
    pair_documents,
    pair_logps,
    pair_terms,
)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
"""Logged per step beside the loss (TRL's names): means over the step's pairs."""


def sequence_targets(input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """Every position's next token within its document (-100 at each document's end)."""
    return torch.from_numpy(next_token_targets(input_ids.numpy(), document_ids.numpy()))


@dataclass
class PairCounts:
    """What the step's objective is normalised by: its real pairs and (ORPO) the chosen
    sequences' target tokens, over the whole global batch."""

    pairs: float
    chosen_tokens: float


def pair_counts(batches: list[dict[str, torch.Tensor | None]]) -> torch.Tensor:
    """[real pairs, chosen sequence target tokens] of this rank's micro-batches (whole rows)."""
    pairs = tokens = 0
    for batch in batches:
        documents = pair_documents(batch["document_ids"])
        response = document_sums(torch.ones_like(batch["targets"]), batch["targets"] != -100, batch["document_ids"], documents)
        sequence = document_sums(torch.ones_like(batch["targets"]), batch["sequence_targets"] != -100,
                                 batch["document_ids"], documents)
        real = (response[:, 0::2] > 0) & (response[:, 1::2] > 0)
        pairs += int(real.sum())
        tokens += int(sequence[:, 0::2][real].sum())
    return torch.tensor([float(pairs), float(tokens)])


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward passes the gradient through unchanged: every rank
    computes the same function of the sum, so each rank's share gets the whole gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass
class PairBatch:
    """One micro-batch's pairs as this rank holds them."""

    documents: int
    """Documents per row, whole pairs (``pair_documents`` of the whole rows)."""
    document_ids: torch.Tensor
    response: torch.Tensor
    """[B, S_local] where a response token is the target."""
    sequence: torch.Tensor
    """[B, S_local] where any token of the sequence is the target."""
    reference: torch.Tensor | None
    """[B, documents / 2, 2]: the reference model's (chosen, rejected) log-probs of each pair slot."""


def pair_batch(batch: dict[str, torch.Tensor | None], held: torch.Tensor | None, reference: np.ndarray | None,
               device: torch.device) -> PairBatch:
    """``batch``'s pairs on this rank (``held``: its positions under cp, None for all), with
    their rows' reference log-probs from ``reference`` [rows, pairs, 2+] (None: reference-free)."""
    documents = pair_documents(batch["document_ids"])
    local = (lambda t: t) if held is None else (lambda t: t[:, held])
    ref = None
    if reference is not None:
        slots = documents // 2
        rows = reference[batch["rows"].numpy(), :slots, :2]
        ref = torch.zeros(rows.shape[0], slots, 2)
        ref[:, :rows.shape[1]] = torch.from_numpy(rows)
        ref = ref.to(device)
    return PairBatch(documents, local(batch["document_ids"]).to(device), local(batch["targets"] != -100).to(device),
                     local(batch["sequence_targets"] != -100).to(device), ref)


def document_totals(nll: torch.Tensor, pairs: PairBatch, cp_group=None) -> torch.Tensor:
    """[3, B, documents]: per document, the response log-prob sum, the response tokens and the
    whole sequence's NLL sum, added up over ``cp_group``."""
    ones = torch.ones_like(nll, dtype=torch.float32)
    totals = torch.stack([
        document_sums(-nll, pairs.response, pairs.document_ids, pairs.documents),
        document_sums(ones, pairs.response, pairs.document_ids, pairs.documents),
        document_sums(nll, pairs.sequence, pairs.document_ids, pairs.documents),
    ])
    return _SumOverRanks.apply(totals, cp_group) if cp_group is not None else totals


def reference_pairs(totals: torch.Tensor) -> list[np.ndarray]:
    """Each row's pairs [pairs, 4] from ``document_totals`` (no grad): the chosen and rejected
    response log-probs, then their response tokens."""
    policy, real = pair_logps(totals[0], totals[1])
    both = torch.stack([policy.chosen, policy.rejected, policy.chosen_tokens, policy.rejected_tokens], dim=1)
    both = both.cpu().numpy()
    per_row = real.sum(dim=1).tolist()
    return list(np.split(both, np.cumsum(per_row)[:-1]))


def pair_objective(nll: torch.Tensor, pairs: PairBatch, method: str, config: PreferenceConfig, counts: PairCounts,
                   cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's share of the step's objective (its pairs' losses over the step's
    pairs, plus ORPO's chosen NLL over the step's chosen tokens) and its metric sums
    [objective, chosen rewards, rejected rewards, correctly ordered pairs, chosen log-probs,
    rejected log-probs] (detached)."""
    totals = document_totals(nll, pairs, cp_group)
    policy, real = pair_logps(totals[0], totals[1])
    reference = None
    if pairs.reference is not None:
        chosen, rejected = pairs.reference[..., 0][real], pairs.reference[..., 1][real]
        reference = PairLogps(chosen, rejected, policy.chosen_tokens, policy.rejected_tokens)
    terms = pair_terms(method, config, policy, reference)
    objective = terms.losses.sum() / max(counts.pairs, 1.0)
    weight = nll_weight(method)
    if weight:
        objective = objective + weight * totals[2][:, 0::2][real].sum() / max(counts.chosen_tokens, 1.0)
    stats = torch.stack([
        objective.detach(), terms.chosen_rewards.sum(), terms.rejected_rewards.sum(),
        (terms.chosen_rewards > terms.rejected_rewards).float().sum(), policy.chosen.detach().sum(),
        policy.rejected.detach().sum(),
    ])
    return objective, stats


STATS = 6
"""Entries of ``pair_objective``'s metric sums."""


def step_metrics(stats: torch.Tensor, pairs: float) -> dict[str, float]:
    """The step's ``METRICS`` from its summed ``pair_objective`` stats."""
    _, chosen, rejected, ordered, chosen_logps, rejected_logps = (float(x) for x in stats.tolist())
    n = max(pairs, 1.0)
    values = (chosen / n, rejected / n, (chosen - rejected) / n, ordered / n, chosen_logps / n, rejected_logps / n)
    return dict(zip(METRICS, values, strict=True))


class PipelinePairLoss:
    """The pipeline schedule's loss function for preference training: the last stage's
    output is a micro-batch's per-token losses; ``queue`` holds the step's ``PairBatch``es in
    micro-batch order (the order the last stage runs them in). With ``counts`` it returns the
    micro-batch's objective times ``scale`` and keeps its metric sums in ``stats``; without
    (the reference pass) it keeps each micro-batch's ``document_totals`` in ``totals``.
    The schedule's own shape-inference call (before its first training step) takes none."""

    def __init__(self, method: str, config: PreferenceConfig, cp_group=None) -> None:
        self.method, self.config, self.cp_group = method, config, cp_group
        self.schedule = None
        """The schedule calling this loss (set once it is built)."""
        self.scale = 1.0
        self.queue: list[PairBatch] = []
        self.counts: PairCounts | None = None
        self.stats: list[torch.Tensor] = []
        self.totals: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        if inferring_shapes(self.schedule):
            return output.sum() * 0
        pairs = self.queue.pop(0)
        if self.counts is None:
            self.totals.append(document_totals(output, pairs, self.cp_group))
            return output.sum() * 0
        objective, stats = pair_objective(output, pairs, self.method, self.config, self.counts, self.cp_group)
        self.stats.append(stats)
        return objective * self.scale


def inferring_shapes(schedule) -> bool:
    """Whether ``schedule`` is inferring its backward's shapes: the first step after building
    (or after an ``eval``) runs the loss function once on stand-in activations first. The
    schedules keep that state in private flags (torch 2.13: single- and multi-stage names)."""
    if schedule is None or not schedule._has_backward:
        return False
    done = getattr(schedule, "_stage_backward_initialized", None)
    return not (done if done is not None else schedule._stages_backward_initialized)
