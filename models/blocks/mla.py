"""Multi-head Latent Attention (MLA; DeepSeek-V2/V3, Kimi K2), computed as transformers'
``DeepseekV3Attention``.

Queries come from ``q_proj``, or through a low-rank bottleneck (``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``). Keys and values come from one compressed latent:
``kv_a_proj_with_mqa`` emits the latent (``kv_lora_rank`` wide) and a rotary key part
(``qk_rope_head_dim``) that every head shares; the latent goes through ``kv_a_layernorm`` and
``kv_b_proj`` into each head's key part without rotary (``qk_nope_head_dim``) and its value
(``v_head_dim``, which may differ from the query/key head's width). Each query/key head is its
part without rotary followed by its rotary part.

With ``rope_interleave`` (DeepSeek's checkpoints) rotary turns adjacent pairs of dims: their
even dims are gathered in front of their odd ones and the rotate-half kernel turns the halves,
which is transformers' ``apply_rotary_pos_emb_interleave`` and leaves queries and keys in that
order.

Generation caches what MLA needs: each position's normalised latent and its rotated rotary key
part, kv_lora_rank + qk_rope_head_dim values per position and layer, shared by every head
(DeepSeek-V3: 576, where per-head keys and values would be 128 x 320 = 40,960, which is what
transformers caches). With a cache, attention runs in the latent space, as DeepSeek's inference
does: each head's query part without rotary is taken through that head's key rows of
``kv_b_proj`` (q W_UK, [kv_lora_rank]), attends over the cached latents and rotary parts as one
shared key/value head, and the result goes through the head's value rows (W_UV). It is the same
product regrouped, q_nope . (W_UK c) = (q_nope W_UK) . c, so no cached position is expanded again
at any step; a LoRA adapter on ``kv_b_proj`` is folded into the rows it uses.

Shapes are read from the weights at run time, so a tensor-parallel plan that gives
``q_b_proj``/``q_proj`` and ``kv_b_proj`` some of the heads needs no change here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.norm import RMSNorm
from llmflow.models.kv_cache import KVCache
from llmflow.models.local import local_part
from llmflow.models.lora import effective_weight

LATENT_NORM_EPS = 1e-6
"""The eps of ``q_a_layernorm`` and ``kv_a_layernorm``: transformers builds them with its
RMSNorm's default, whatever ``rms_norm_eps`` says."""


class MultiHeadLatentAttention(nn.Module):
    sliding_window = None
    """Every position attends to every earlier one (read by context parallelism, as ``Attention``'s)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        bias: bool = False,
        rope_interleave: bool = False,
    ) -> None:
        """``q_lora_rank`` None: one ``q_proj``; ``scale``: the softmax scale (DeepSeek-V3:
        qk_head_dim^-0.5, times YaRN's mscale squared); ``bias``: on the projections from the
        hidden states (``q_a_proj``, ``kv_a_proj_with_mqa``) and on ``o_proj``."""
        super().__init__()
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.rope_interleave = rope_interleave
        self.low_rank_query = q_lora_rank is not None
        """Whether queries go through ``q_a_proj``/``q_b_proj`` (else one ``q_proj``)."""
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if self.low_rank_query:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.shared_key_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by the tensor-parallel training plan (``models/parallelize.py``): the rotary key
        part unchanged, its gradient summed over the ranks, each of which holds some of the
        heads that share it."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_query else self.q_proj(x)
        q = q.view(batch, seq, -1, self.qk_nope_head_dim + self.qk_rope_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = k_rot.view(batch, 1, seq, self.qk_rope_head_dim)
        if self.shared_key_gradient is not None:
            k_rot = self.shared_key_gradient(k_rot)
        q_rot, k_rot = self._rotary(q_rot, cos, sin), self._rotary(k_rot, cos, sin)
        if cache is not None:
            out = self._latent_attention(q_nope, q_rot, latent.unsqueeze(1), k_rot, document_ids, cache)
        else:
            kv = self.kv_b_proj(latent).view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            q = torch.cat([q_nope, q_rot], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
            out = self.core_attention(q, k, v, document_ids)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       document_ids: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of q/k [B, H, S, qk_head_dim] and v [B, H, S, v_head_dim] in training
        and prefill: the step context parallelism replaces (``models/context_parallel.py``)."""
        return kernels.attention(q, k, v, self.scale, document_ids)

    def local_sinks(self) -> None:
        """No attention sinks (``Attention.local_sinks``' counterpart for context parallelism)."""

    def _latent_attention(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                          document_ids: torch.Tensor | None, cache: tuple[KVCache, str]) -> torch.Tensor:
        """Attention over the cached latents [B, 1, S, kv_lora_rank] and rotary key parts
        [B, 1, S, qk_rope_head_dim] (the new positions' written first); [B, H, Sq, v_head_dim]."""
        weight = local_part(effective_weight(self.kv_b_proj))  # this rank's heads
        up = weight.to(q_nope.dtype).view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        key_rows, value_rows = up.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        batch, _, seq, _ = latent.shape
        keys, _ = cache[0].update(cache[1], torch.cat([latent, k_rot], dim=-1), latent.new_empty(batch, 1, seq, 0))
        q = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, key_rows), q_rot], dim=-1)
        out = kernels.attention(q, keys, keys[..., : self.kv_lora_rank], self.scale, document_ids,
                                query_start=cache[0].query_start)
        return torch.einsum("bhsr,hvr->bhsv", out, value_rows)

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return kernels.apply_rotary(x, cos, sin)
