"""Causal self-attention with rotary positions: multi-head or grouped-query, optional biases,
sliding window and per-head RMSNorm of queries and keys, appending to a ``KVCache`` during
generation.

Shapes are read from the weights at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that shards heads needs no change here.
"""

from __future__ import annotations

import torch
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.norm import RMSNorm
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
        qk_norm_eps: float | None = None,
    ) -> None:
        """``qk_norm_eps``: the eps of an RMSNorm over each head's queries and keys
        (``q_norm``, ``k_norm``, weights [head_dim]) before rotary; None: no such norm."""
        super().__init__()
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        norms = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if norms else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if norms else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # on [B, S, heads, head_dim], the layout tensor-parallel plans shard (dim 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q = kernels.apply_rotary(q.transpose(1, 2), cos, sin)
        k = kernels.apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache[0].update(cache[1], k, v)
        out = kernels.attention(q, k, v, self.scale, document_ids, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
