"""The pre-norm decoder layer: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``.

A family fills its two slots: any token mixer that takes (x, cos, sin, document_ids, cache)
(attention, or a Gated DeltaNet registered under HF's name ``linear_attn``) and any
feed-forward block that takes x (a dense MLP, or a mixture of experts).
"""

from __future__ import annotations

import torch
from torch import nn

from llmflow.models.blocks.norm import rms_norm
from llmflow.models.kv_cache import KVCache


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, rms_norm_eps: float, self_attn: nn.Module, mlp: nn.Module, *,
                 mixer_name: str = "self_attn", zero_centered_norm: bool = False) -> None:
        """``mixer_name``: the module name of the token mixer (``linear_attn`` for a Gated
        DeltaNet); ``zero_centered_norm``: both norms store their weight zero-centred."""
        super().__init__()
        self.input_layernorm = rms_norm(hidden_size, rms_norm_eps, zero_centered_norm)
        self.mixer_name = mixer_name
        self.add_module(mixer_name, self_attn)
        self.post_attention_layernorm = rms_norm(hidden_size, rms_norm_eps, zero_centered_norm)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        mixer, h = getattr(self, self.mixer_name), self.input_layernorm(x)
        # A cache by keyword, and only when there is one: a tensor-parallel plan gives the mixer's
        # positional inputs fixed layouts, and a training step's calls stay as a probe records them.
        x = x + (mixer(h, cos, sin, document_ids) if cache is None else mixer(h, cos, sin, document_ids, cache=cache))
        return x + self.mlp(self.post_attention_layernorm(x))
