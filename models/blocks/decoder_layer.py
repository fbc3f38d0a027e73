"""The pre-norm decoder layer: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``.

A family fills its two slots: any attention block that takes (x, cos, sin, document_ids,
cache) and any feed-forward block that takes x (a dense MLP, or a mixture of experts).
"""

from __future__ import annotations

import torch
from torch import nn

from llmflow.models.blocks.norm import RMSNorm
from llmflow.models.kv_cache import KVCache


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, rms_norm_eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        # Tensor-parallel plans give self_attn fixed input layouts: pass a cache only when there is one.
        cached = (cache,) if cache is not None else ()
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, document_ids, *cached)
        return x + self.mlp(self.post_attention_layernorm(x))
