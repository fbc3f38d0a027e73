"""DeepSeek-V3's router, also Kimi K2's and GLM-4.5's: sigmoid scores, a correction bias that
steers which experts are chosen (never their weights), top-k limited to the best groups of
experts, and routing weights times ``routed_scaling_factor``.

It has ``TopKRouter``'s interface (``models/blocks/moe.py``): x -> (probabilities, weights,
experts), so the ``MoE`` block runs either. Its probabilities are the sigmoid scores
normalised over the experts, what DeepSeek-V3's balance losses average.

The correction bias is a buffer, as in transformers: no gradient moves it, auxiliary-loss-free
balancing does (``corrected_bias``, applied by the training loop after each optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class GroupLimitedRouter(nn.Module):
    """``weight`` [experts, hidden] and ``e_score_correction_bias`` [experts] (fp32). For each
    token: scores = sigmoid(logits) in fp32; the experts split into ``n_group`` consecutive
    groups, each scored by the sum of its two best biased scores (score + bias); the experts
    of the ``topk_group`` best groups compete for the token's ``top_k`` by biased score; their
    weights are their unbiased scores, renormalised to sum to one when ``norm_topk_prob``,
    times ``routed_scaling_factor``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool, *,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts cannot keep {topk_group} of {n_group} equal groups")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (normalised scores [tokens, experts] fp32, weights [tokens, k]
        in x's dtype, expert indices [tokens, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:
            grouped = choice.view(-1, self.n_group, choice.shape[-1] // self.n_group)
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
            kept = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1).bool()
            choice = grouped.masked_fill(~kept[..., None], float("-inf")).view_as(choice)
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        probabilities = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return probabilities, weights.to(x.dtype), experts

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GroupLimitedRouter:
        # The bias stays fp32 when the model is cast (transformers keeps it so): in bf16 the
        # small per-expert differences that steer the choice would round away.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != bias.dtype:
            self.e_score_correction_bias = bias.to(moved.device)
        return self


def corrected_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3; megatron-core's ``get_updated_expert_bias``):
    each expert's bias moves by ``rate`` towards balance, up for an expert that received fewer
    tokens than the mean over experts, down for one that received more. ``tokens_per_expert``
    [..., experts] counts every rank's tokens of the step."""
    tokens = tokens_per_expert.float()
    mean = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1]
    return bias + torch.sign(mean - tokens) * rate
