"""The SwiGLU feed-forward block (also the shape of one mixture-of-experts expert)."""

from __future__ import annotations

import torch
from torch import nn

from llmflow import kernels


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))
