"""GRPO's advantages and per-token loss, as TRL 1.16's ``GRPOTrainer`` computes them
(``_generate_and_score_completions`` and ``_compute_loss``), and the aggregation of a
micro-batch's token losses into its share of the step's objective.

Tensors are [B, T] over a micro-batch's completions, aligned with the tokens they score;
``mask`` marks the tokens that count (a completion's tokens, none of a truncated one's under
``mask_truncated_completions``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmflow.train.grpo.config import RLConfig

STD_EPS = 1e-4
"""Added to the standard deviation advantages are divided by (TRL's)."""


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation ignoring NaN (NaN from fewer than two values), as TRL's ``nanstd``."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage [N] from the weighted rewards [N] of a generation batch whose
    groups are ``num_generations`` consecutive completions (NaN: unscorable), and whether its
    scaling standard deviation is zero [N] (``frac_reward_zero_std``)."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # group, and none (whose std only tells zero-variance groups apart)
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass
class TokenTerms:
    losses: torch.Tensor
    """Per-token loss [B, T] (or [B, 1] broadcast at the sequence level)."""
    ratio: torch.Tensor
    """The importance ratio [B, T] or [B, 1]."""
    kl: torch.Tensor | None
    """The per-token KL estimate [B, T] (beta > 0)."""


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, mask: torch.Tensor, rl: RLConfig) -> TokenTerms:
    """The clipped surrogate loss of every token, plus beta times the k3 KL estimate."""
    log_ratio = logps - old_logps
    if rl.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - rl.epsilon, 1 + rl.clip_high)
    losses = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if rl.beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if rl.use_bias_correction_kl:
            kl = kl * ratio
        losses = losses + rl.beta * kl
    return TokenTerms(losses, ratio, kl)


@dataclass
class StepCounts:
    """What the step's objective is normalised by, over the whole global batch."""

    completions: float
    """The step's completions (grpo, dr_grpo)."""
    tokens_per_step: float
    """The generation batch's tokens that count, over its steps_per_generation (dapo)."""
    micro_batches: float
    """Micro-batches of the step over every rank (bnpo: each one's token mean counts alike)."""


def aggregate(losses: torch.Tensor, mask: torch.Tensor, rl: RLConfig, counts: StepCounts) -> torch.Tensor:
    """A micro-batch's share of the step's loss under ``rl.loss_type``."""
    masked = losses * mask
    if rl.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts.completions
    if rl.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / counts.micro_batches
    if rl.loss_type == "dr_grpo":
        return masked.sum() / (counts.completions * rl.max_completion_length)
    return masked.sum() / max(counts.tokens_per_step, 1.0)


CLIP_SUMS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def clip_statistics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    rl: RLConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sums of the low, high and region clipped indicators [3], what they are counted over
    (tokens, or completions at the sequence level), the completions' lowest share of low-clipped
    tokens, and their highest share of high-clipped tokens), the terms of TRL's clip_ratio metrics."""
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1 - rl.epsilon) & (adv < 0)).float()
    high = ((ratio > 1 + rl.clip_high) & (adv > 0)).float()
    region = torch.maximum(low, high)
    if ratio.shape[1] == 1:  # one ratio per completion
        sums = torch.stack([low.sum(), high.sum(), region.sum()])
        count = torch.tensor(float(ratio.shape[0]), device=ratio.device)
        per_low, per_high = low.squeeze(1), high.squeeze(1)
    else:
        sums = torch.stack([(low * mask).sum(), (high * mask).sum(), (region * mask).sum()])
        count = mask.sum().float()
        tokens = mask.sum(-1)
        per_low, per_high = (low * mask).sum(-1) / tokens, (high * mask).sum(-1) / tokens
    lowest = per_low[~per_low.isnan()].min() if (~per_low.isnan()).any() else torch.tensor(float("inf"))
    highest = per_high[~per_high.isnan()].max() if (~per_high.isnan()).any() else torch.tensor(float("-inf"))
    return sums, count, lowest.to(ratio.device), highest.to(ratio.device)
