"""The gated feed-forward block: SwiGLU, or GeGLU (Gemma); SwiGLU is also the shape of one
mixture-of-experts expert."""

from __future__ import annotations

import torch
from torch import nn

from llmflow import kernels

ACTIVATIONS = {"silu": kernels.swiglu, "gelu_pytorch_tanh": kernels.geglu}
"""The gate's activation by its transformers name, and the op computing act(gate) * up."""


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str = "silu") -> None:
        """``activation``: the gate's, one of ``ACTIVATIONS``."""
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gated = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))
