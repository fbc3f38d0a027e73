"""The mixture-of-experts feed-forward block: a top-k router, routed SwiGLU experts whose
weights are stacked per projection ([experts, out, in], computed with one grouped matmul),
and an optional shared expert with a sigmoid gate (Qwen2-MoE).

Routing is dropless: every token reaches its k experts whatever the load. The block keeps
the statistics of its last forward (``routing``): after the model's forward,
``load_balancing_loss`` computes the load-balancing auxiliary loss from them as transformers'
``load_balancing_loss_func`` computes it from the router logits of every layer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.mlp import MLP


@dataclass
class Routing:
    """What one MoE layer's router did in its last forward."""

    tokens_per_expert: torch.Tensor
    """[experts] how many (token, choice) assignments each expert received (no gradient)."""
    probability_sum: torch.Tensor
    """[experts] the router's softmax probabilities summed over the tokens (fp32, with gradient)."""
    tokens: int
    """Tokens routed."""


class TopKRouter(nn.Module):
    """``weight`` [experts, hidden]: softmax over the experts' logits (fp32), the k largest
    probabilities as routing weights, renormalised to sum to one when ``norm_topk_prob``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (probabilities [tokens, experts] fp32, weights [tokens, k]
        in x's dtype, expert indices [tokens, k])."""
        probabilities = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probabilities, weights.to(x.dtype), experts


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, one tensor per projection with the experts along
    dim 0, each expert's slice laid out as nn.Linear's weight (``gate_proj`` [E, I, H],
    ``up_proj`` [E, I, H], ``down_proj`` [E, H, I])."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] holds ``counts[e]`` rows for each expert e, in expert order (under
        expert parallelism: this rank's experts, ``models/expert_parallel.py``); each row's
        output times ``scale`` [N, 1] when given (applied to the SwiGLU's output, the narrower
        of the down projection's two sides)."""
        gate, up, down = (_local(w, x.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        hidden = kernels.swiglu(kernels.grouped_mm(x, gate, counts), kernels.grouped_mm(x, up, counts))
        if scale is not None:
            hidden = hidden * scale
        return kernels.grouped_mm(hidden, down, counts)


def _local(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This rank's experts of a weight expert parallelism split (a DTensor), in the compute dtype.
    DTensor is looked up, not imported: importing it takes a second, and a DTensor exists only
    where the code that made it has imported it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return (weight.to_local() if dtensor and isinstance(weight, dtensor.DTensor) else weight).to(dtype)


class MoE(nn.Module):
    """Hugging Face's sparse MoE block (``mlp``): ``gate`` (the router), ``experts`` and, in
    Qwen2-MoE, ``shared_expert`` with ``shared_expert_gate``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int = 0) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(hidden_size, intermediate_size, num_experts)
        shared = shared_expert_intermediate_size > 0
        self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size, bias=False) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared else None
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probabilities, weights, experts = self.gate(tokens)
        choices = experts.reshape(-1)
        # Counted by scatter_add_, not bincount: bincount sizes its output from the largest
        # index, a device-to-host sync per layer on an accelerator (and a dynamic shape
        # torch.compile cannot trace); scatter_add_ is also deterministic on CUDA.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=choices.device)
        counts.scatter_add_(0, choices, torch.ones_like(choices))
        self.routing = Routing(counts.detach(), probabilities.sum(dim=0), tokens.shape[0])
        # Every (token, choice) pair once, grouped by expert; stable, so tokens keep their order.
        order = torch.argsort(choices, stable=True)
        source = order // experts.shape[1]
        # index_select, whose backward is index_add_ (advanced indexing's is the slower
        # accumulating index_put_); the routing weight scales each pair's SwiGLU output.
        routed = self.experts(tokens.index_select(0, source), counts, weights.reshape(-1, 1)[order])
        out = torch.zeros_like(tokens).index_add_(0, source, routed)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.view(shape)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE block of ``model`` with its module name."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def load_balancing_loss(blocks: Iterable[MoE], group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Switch Transformer's auxiliary loss over the last forward of ``blocks``, as transformers'
    ``load_balancing_loss_func`` computes it over every layer's router logits: the number of
    experts times the sum over experts of (their share of the assignments) x (their mean
    routing probability), both taken over every layer's tokens together. None without MoE.

    With ``group`` (the data-parallel ranks, each holding a slice of the batch), the counts
    are summed over its ranks first and each rank returns its share of the loss of the whole
    batch: the shares add up to the loss one process computes over every rank's tokens."""
    routings = [block.routing for block in blocks if block.routing is not None]
    if not routings:
        return None
    assigned = torch.stack([r.tokens_per_expert for r in routings]).sum(0).float()
    counts = torch.cat([assigned, assigned.new_tensor([sum(r.tokens for r in routings)])])
    if group is not None:
        dist.all_reduce(counts, group=group)
    rows = counts[-1]
    probability = torch.stack([r.probability_sum for r in routings]).sum(0) / rows
    return assigned.numel() * torch.sum(counts[:-1] / rows * probability)
