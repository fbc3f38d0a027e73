"""Causal self-attention with rotary positions: multi-head or grouped-query, optional biases,
sliding window, per-head RMSNorm of queries and keys, rotary on part of each head (cos/sin
narrower than the head rotate its first dims, the rest pass through), and a sigmoid output
gate (Qwen3-Next, Qwen3.5) and attention sinks (gpt-oss), appending to a ``KVCache`` during generation.

Shapes are read from the weights at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that shards heads needs no change here; context parallelism replaces
``core_attention`` alone.
"""

from __future__ import annotations

import torch
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.norm import rms_norm
from llmflow.models.kv_cache import KVCache
from llmflow.models.local import local_part


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
        zero_centered_norm: bool = False,
        output_gate: bool = False,
        scale: float | None = None,
        sinks: bool = False,
    ) -> None:
        """``qk_norm_eps``: the eps of an RMSNorm over each head's queries and keys
        (``q_norm``, ``k_norm``, weights [head_dim]) before rotary, zero-centred when
        ``zero_centered_norm``; None: no such norm. ``output_gate``: ``q_proj`` emits each
        head's queries followed by as many gate values, and the attention output is scaled
        by their sigmoid before ``o_proj``. ``scale``: the softmax scale of the scores
        (None: head_dim ** -0.5). ``sinks``: a learned logit per query head (``sinks`` [heads])
        joins every query's softmax as a column whose probability is dropped."""
        super().__init__()
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        norms = qk_norm_eps is not None
        self.q_norm = rms_norm(head_dim, qk_norm_eps, zero_centered_norm) if norms else None
        self.k_norm = rms_norm(head_dim, qk_norm_eps, zero_centered_norm) if norms else None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # on [B, S, heads, head_dim], the layout tensor-parallel plans shard (dim 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotary(q.transpose(1, 2), cos, sin)
        k = _rotary(k.transpose(1, 2), cos, sin)
        if cache is None:
            out = self.core_attention(q, k, v, document_ids)
        else:  # generation, never under context parallelism
            k, v = cache[0].update(cache[1], k, v)
            out = kernels.attention(q, k, v, self.scale, document_ids, self.sliding_window, self.local_sinks(),
                                    query_start=cache[0].query_start)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       document_ids: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of q [B, Hq, S, D] over k/v [B, Hkv, S', D]: the step context
        parallelism replaces (``models/context_parallel.py``)."""
        return kernels.attention(q, k, v, self.scale, document_ids, self.sliding_window, self.local_sinks())

    def local_sinks(self) -> torch.Tensor | None:
        """The sinks of this rank's heads (a tensor-parallel plan splits them with the heads)."""
        return None if self.sinks is None else local_part(self.sinks)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] dims of each head of x [B, heads, S, D] (partial
    rotary), the rest unchanged."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return kernels.apply_rotary(x, cos, sin)
    return torch.cat([kernels.apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
