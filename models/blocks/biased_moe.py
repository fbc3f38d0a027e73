"""gpt-oss's router and experts, for the ``MoE`` block: a router with a bias whose weights are
the softmax over each token's k largest logits, and experts with biases on both projections
computing a clamped SwiGLU of interleaved gate/up columns.

The experts keep the checkpoint's layout, [in, out] per expert (``gate_up_weight`` [E, hidden,
2 inter], gate and up columns alternating; ``down_weight`` [E, inter, hidden]), which
``kernels.grouped_mm`` takes transposed (views, no copy).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.moe import TopKRouter
from llmflow.models.expert_adapters import ExpertAdapterPart, adapted_expert_weight, expert_deltas
from llmflow.models.local import local_part


class BiasedTopKRouter(TopKRouter):
    """``weight`` [experts, hidden] and ``bias`` [experts]: the k largest logits of each token,
    their softmax the routing weights (in the logits' dtype); the probabilities that balance
    losses average are the softmax over every expert's logit (fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob=False)
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(logits.float(), dim=-1), torch.softmax(top, dim=-1).to(x.dtype), experts


class ClampedSwiGLUExperts(nn.Module):
    """The routed experts of gpt-oss: for each row, gate_up = x W_gu + b_gu; gate (even
    columns) clamped to at most ``limit``, up (odd columns) to [-limit, limit];
    out = ((up + 1) * gate * sigmoid(alpha * gate)) W_d + b_d."""

    LORA_PARTS: ClassVar[dict[str, ExpertAdapterPart]] = {"gate_up_weight": ExpertAdapterPart("gate_up_proj", transposed=True),
                  "down_weight": ExpertAdapterPart("down_proj", transposed=True)}
    """The checkpoint's ``gate_up_proj`` and ``down_proj`` as they are ([in, out] per expert),
    which LoRA's ``target_parameters`` name."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, alpha: float,
                 limit: float) -> None:
        super().__init__()
        self.lora: nn.ModuleDict | None = None
        """LoRA adapters by the checkpoint's weight name (``models/lora.py``), or None."""
        self.gate_up_weight = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
        self.down_weight = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.alpha = alpha
        self.limit = limit

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] holds ``counts[e]`` rows for each expert e, in expert order; each row's
        output (biases included) times ``scale`` [N, 1] when given."""
        rows = x.shape[0]
        deltas = expert_deltas(self, x.dtype)
        gate_up_weight, down_weight = (adapted_expert_weight(self, name, local_part(getattr(self, name)).to(x.dtype),
                                                             deltas) for name in ("gate_up_weight", "down_weight"))
        gate_up = kernels.grouped_mm(x, gate_up_weight.transpose(1, 2), counts)
        gate_up = gate_up + local_part(self.gate_up_bias).to(x.dtype).repeat_interleave(counts, dim=0, output_size=rows)
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = kernels.grouped_mm(hidden, down_weight.transpose(1, 2), counts)
        out = out + local_part(self.down_bias).to(x.dtype).repeat_interleave(counts, dim=0, output_size=rows)
        return out if scale is None else out * scale
