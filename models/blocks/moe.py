"""The mixture-of-experts feed-forward block: a router (the softmax ``TopKRouter``, or
DeepSeek-V3's ``GroupLimitedRouter`` from ``moe_routing.py``), routed SwiGLU experts whose
weights are stacked per projection ([experts, out, in], computed with one grouped matmul),
and an optional shared expert, with a sigmoid gate (Qwen2-MoE) or without (DeepSeek-V3's
``shared_experts``).

Routing is dropless: every token reaches its k experts whatever the load. The block keeps
the statistics of its last forward (``routing``): after the model's forward,
``load_balancing_loss`` computes the load-balancing auxiliary loss from them as transformers'
``load_balancing_loss_func`` computes it from the router logits of every layer, and
``sequence_balancing_loss`` DeepSeek-V3's sequence-wise auxiliary loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.mlp import MLP
from llmflow.models.expert_adapters import ExpertAdapterPart, adapted_expert_weight, expert_deltas
from llmflow.models.local import local_part


@dataclass
class Routing:
    """What one MoE layer's router did in its last forward."""

    tokens_per_expert: torch.Tensor
    """[experts] how many (token, choice) assignments each expert received (no gradient)."""
    probability_sum: torch.Tensor
    """[experts] the router's probabilities summed over the tokens (fp32, with gradient)."""
    tokens: int
    """Tokens routed."""
    top_k: int = 1
    """Experts each token was routed to."""
    sequences: int = 1
    """Sequences the tokens came in (the input's batch dimension), each as many tokens long."""
    probabilities: torch.Tensor | None = None
    """[tokens, experts] the router's probabilities (with gradient), kept only when the block's
    ``keep_probabilities`` asks for them (a sequence-wise auxiliary loss is trained)."""


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

    LORA_PARTS: ClassVar[dict[str, ExpertAdapterPart]] = {"gate_proj": ExpertAdapterPart("gate_up_proj", 0, 2), "up_proj": ExpertAdapterPart("gate_up_proj", 1, 2),
                  "down_proj": ExpertAdapterPart("down_proj")}
    """Where each weight sits in transformers' (``gate_up_proj`` [E, 2I, H], gate rows first;
    ``down_proj``), which LoRA's ``target_parameters`` name."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.lora: nn.ModuleDict | None = None
        """LoRA adapters by transformers' weight name (``models/lora.py``), or None."""
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] holds ``counts[e]`` rows for each expert e, in expert order (under
        expert parallelism: this rank's experts, ``models/expert_parallel.py``); each row's
        output times ``scale`` [N, 1] when given (applied to the SwiGLU's output, the narrower
        of the down projection's two sides)."""
        deltas = expert_deltas(self, x.dtype)
        gate, up, down = (adapted_expert_weight(self, name, local_part(getattr(self, name)).to(x.dtype), deltas)
                          for name in ("gate_proj", "up_proj", "down_proj"))
        hidden = kernels.swiglu(kernels.grouped_mm(x, gate, counts), kernels.grouped_mm(x, up, counts))
        if scale is not None:
            hidden = hidden * scale
        return kernels.grouped_mm(hidden, down, counts)


class MoE(nn.Module):
    """Hugging Face's sparse MoE block (``mlp``): ``gate`` (the router), ``experts`` and, in
    Qwen2-MoE, ``shared_expert`` with ``shared_expert_gate``, in DeepSeek-V3 and GLM-4.5
    ``shared_experts`` (ungated)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int = 0, *,
                 shared_expert_gated: bool = True, router: nn.Module | None = None,
                 experts: nn.Module | None = None) -> None:
        """``router``: a module with ``TopKRouter``'s interface (default: a ``TopKRouter``);
        ``experts``: a module with ``GroupedExperts``' forward (default: ``GroupedExperts``);
        ``shared_expert_gated``: the shared expert's output scaled by its sigmoid gate, else
        added as it is."""
        super().__init__()
        self.num_experts = num_experts
        self.gate = router if router is not None else TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = experts if experts is not None else GroupedExperts(hidden_size, intermediate_size, num_experts)
        shared = shared_expert_intermediate_size > 0
        gated = shared and shared_expert_gated
        self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size, bias=False) if gated else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if gated else None
        self.shared_experts = MLP(hidden_size, shared_expert_intermediate_size, bias=False) if shared and not gated else None
        self.routing: Routing | None = None
        self.keep_probabilities = False
        """Set by training when it needs every token's probabilities (``Routing.probabilities``)."""

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
        self.routing = Routing(counts.detach(), probabilities.sum(dim=0), tokens.shape[0], experts.shape[1],
                               shape[0] if len(shape) > 2 else 1, probabilities if self.keep_probabilities else None)
        # Every (token, choice) pair once, grouped by expert; stable, so tokens keep their order.
        order = torch.argsort(choices, stable=True)
        source = order // experts.shape[1]
        # index_select, whose backward is index_add_ (advanced indexing's is the slower
        # accumulating index_put_); the routing weight scales each pair's SwiGLU output.
        routed = self.experts(tokens.index_select(0, source), counts, weights.reshape(-1, 1)[order])
        out = torch.zeros_like(tokens).index_add_(0, source, routed)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
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


def sequence_balancing_loss(blocks: Iterable[MoE], sequence_groups: Iterable[dist.ProcessGroup | None] = (),
                            dp_group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """DeepSeek-V3's sequence-wise auxiliary loss over the last forward of ``blocks`` (each
    keeping its probabilities), as megatron-core's ``seq_aux_loss``: for each layer and
    sequence of T tokens, the sum over experts of f_e * P_e, where f_e = experts / (k T) times
    the number of the sequence's tokens whose k most probable experts include e, and P_e is
    e's probability averaged over the sequence's tokens; averaged over the sequences and summed
    over the layers. None without MoE.

    Each rank holds some of the sequences (the ranks of ``dp_group``), or a shard of each
    (``sequence_groups``: the context- and tensor-parallel groups): the counts are summed over
    the shards of a sequence and each rank returns its share of the loss, the shares adding up
    to the loss of every rank's sequences together."""
    routings = [block.routing for block in blocks if block.routing is not None]
    if not routings:
        return None
    if any(r.probabilities is None for r in routings):
        raise ValueError("a sequence-wise auxiliary loss needs each MoE block's probabilities (keep_probabilities)")
    first = routings[0]
    top_k, experts = first.top_k, first.probabilities.shape[-1]
    probabilities = [r.probabilities.view(r.sequences, -1, experts) for r in routings]  # [sequences, T, experts]
    counts = []  # [sequences, experts] per layer: how many of a sequence's tokens have e among their top k
    for p in probabilities:
        chosen = p.detach().topk(top_k, dim=-1).indices.flatten(1)
        counts.append(torch.zeros_like(p[:, 0]).scatter_add_(1, chosen, torch.ones_like(chosen, dtype=p.dtype)))
    totals = torch.cat([torch.stack(counts).flatten(), probabilities[0].new_tensor([probabilities[0].shape[1]])])
    for group in sequence_groups:
        if group is not None:
            dist.all_reduce(totals, group=group)
    sequences = probabilities[0].new_tensor(float(first.sequences))
    if dp_group is not None:
        dist.all_reduce(sequences, group=dp_group)
    length = totals[-1]
    f = totals[:-1].view(len(counts), *counts[0].shape) * (experts / (top_k * length))
    shares = torch.stack([(f_layer * p.sum(dim=1)).sum() for f_layer, p in zip(f, probabilities, strict=True)])
    return shares.sum() / (length * sequences)
