"""Causal self-attention with rotary positions: multi-head or grouped-query, optional biases
and sliding window, appending to a ``KVCache`` during generation.

Shapes are read from the weights at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that shards heads needs no change here.
"""

from __future__ import annotations

import torch
from torch import nn

from llmflow import kernels
from llmflow.models.kv_cache import KVCache


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q = kernels.apply_rotary(q, cos, sin)
        k = kernels.apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache[0].update(cache[1], k, v)
        out = kernels.attention(q, k, v, self.scale, document_ids, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
