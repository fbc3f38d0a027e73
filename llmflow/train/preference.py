"""Preference objectives on chosen/rejected pairs: DPO (sigmoid, IPO, robust), SimPO and ORPO,
with TRL's definitions (``DPOTrainer``, ``CPOTrainer(loss_type="simpo", cpo_alpha=0)``,
``ORPOTrainer``).

A preference row holds pairs side by side as packed documents: document 2k is pair k's
chosen sequence, 2k+1 its rejected one (prompt and response, the prompt's targets -100),
and padding is one more document. ``pair_logps`` adds the model's per-token log-probs up per
document; the objective of a global batch is

    sum over its pairs of ``PairTerms.losses`` / its pairs
    + ``nll_weight`` * (sum of the chosen sequences' token NLL) / their tokens

(ORPO's supervised term: TRL takes the chosen sequence's NLL over prompt and response), so
any split over micro-batches and ranks adds up to one process's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

Method = Literal["dpo", "simpo", "orpo"]
METHODS: tuple[str, ...] = ("dpo", "simpo", "orpo")


class PreferenceConfig(BaseModel):
    """Settings of the preference objective (``method`` dpo, simpo or orpo); TRL's names and defaults."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    beta: float = Field(default=0.1, gt=0)
    """dpo: how far the policy may move from the reference (higher: less; TRL's beta, 0.1);
    simpo: the reward scale (TRL's CPO beta, 0.1; the SimPO paper uses 2.0-2.5); orpo: the
    weight of the odds-ratio term against the supervised loss (the paper's lambda, 0.1)."""
    loss_type: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    """dpo only. sigmoid: the DPO paper's -log sigmoid(beta * margin); ipo: IPO's squared loss
    (margin - 1/(2 beta))^2 on log-ratios averaged per response token, as TRL; robust: the
    robust DPO loss for noisy preferences, which needs label_smoothing."""
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """dpo robust: the assumed share of flipped preference labels (0 <= x < 0.5); simpo: the
    conservative loss's label smoothing. Not used by sigmoid, ipo or orpo."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin (TRL's simpo_gamma)."""
    reference: Path | None = None
    """dpo: directory of the reference model's cached log-probs of the training pairs (the
    reference stage writes it; it is computed when missing or made from other inputs).
    Default: {out}/reference."""

    @model_validator(mode="after")
    def _smoothing_needs_a_loss(self) -> PreferenceConfig:
        if self.label_smoothing and self.loss_type == "ipo":
            raise ValueError("preference.label_smoothing is used by loss_type robust (and simpo), not ipo")
        return self


@dataclass
class PairLogps:
    """Per-pair sums of response log-probs and response token counts, [P] each."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass
class PairTerms:
    losses: torch.Tensor
    """Each pair's loss [P]."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    """The implicit rewards [P] (detached), TRL's rewards/chosen and rewards/rejected."""


def document_sums(values: torch.Tensor, mask: torch.Tensor, document_ids: torch.Tensor, documents: int) -> torch.Tensor:
    """``values`` [B, S] summed per document where ``mask``: [B, documents] (ids >= documents dropped)."""
    values = torch.where(mask, values, 0).to(torch.float32)
    index = document_ids.clamp(max=documents).to(torch.int64)
    sums = torch.zeros(values.shape[0], documents + 1, dtype=values.dtype, device=values.device)
    return sums.scatter_add(1, index, values)[:, :documents]


def pair_documents(document_ids: torch.Tensor) -> int:
    """Documents a batch of rows has room for, rounded up to whole pairs (its padding, one more
    document, then never lands in a pair with tokens)."""
    documents = int(document_ids.max()) + 1
    return documents + documents % 2


def split_pairs(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document values [B, 2P] -> (chosen, rejected) [B, P]."""
    return sums[:, 0::2], sums[:, 1::2]


def pair_logps(sums: torch.Tensor, counts: torch.Tensor) -> tuple[PairLogps, torch.Tensor]:
    """Per-document response log-prob sums and target counts [B, 2P] -> the real pairs' (both
    sequences with response tokens) ``PairLogps`` [P'] and the mask [B, P] that picked them."""
    chosen, rejected = split_pairs(sums)
    chosen_tokens, rejected_tokens = split_pairs(counts)
    real = (chosen_tokens > 0) & (rejected_tokens > 0)
    return PairLogps(chosen[real], rejected[real], chosen_tokens[real], rejected_tokens[real]), real


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_terms(method: str, config: PreferenceConfig, policy: PairLogps, reference: PairLogps | None) -> PairTerms:
    """Each pair's loss and implicit rewards under ``method`` (``reference`` for dpo)."""
    beta = config.beta
    if method == "dpo":
        if reference is None:
            raise ValueError("dpo needs the reference model's log-probs")
        chosen_ratio = policy.chosen - reference.chosen
        rejected_ratio = policy.rejected - reference.rejected
        margin = chosen_ratio - rejected_ratio
        if config.loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * margin)
        elif config.loss_type == "ipo":
            per_token = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1)
            losses = (per_token - 1 / (2 * beta)) ** 2
        else:
            eps = config.label_smoothing
            losses = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
        return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    if method == "simpo":
        logits = chosen - rejected - config.simpo_gamma / beta
        eps = config.label_smoothing
        losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    elif method == "orpo":
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        losses = -beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach())


def nll_weight(method: str) -> float:
    """Weight of the chosen sequences' token-mean NLL in the objective: ORPO's supervised term."""
    return 1.0 if method == "orpo" else 0.0
