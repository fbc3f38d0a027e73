"""The pre-norm decoder layer: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``; and its
sandwich variant (Gemma 3), which also normalises each block's output before the residual add.

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

    def mix(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None,
            cache: tuple[KVCache, str] | None) -> torch.Tensor:
        """The token mixer's output for its normalised input ``h``."""
        mixer = getattr(self, self.mixer_name)
        # A cache by keyword, and only when there is one: a tensor-parallel plan gives the mixer's
        # positional inputs fixed layouts, and a training step's calls stay as a probe records them.
        return mixer(h, cos, sin, document_ids) if cache is None else mixer(h, cos, sin, document_ids, cache=cache)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        x = x + self.mix(self.input_layernorm(x), cos, sin, document_ids, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """``x + post_attention_layernorm(self_attn(input_layernorm(x)))``, then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (Gemma 3, HF's names):
    here ``post_attention_layernorm`` normalises attention's output, and
    ``pre_feedforward_layernorm`` is the MLP's input norm."""

    def __init__(self, hidden_size: int, rms_norm_eps: float, self_attn: nn.Module, mlp: nn.Module, *,
                 mixer_name: str = "self_attn", zero_centered_norm: bool = False) -> None:
        super().__init__(hidden_size, rms_norm_eps, self_attn, mlp, mixer_name=mixer_name,
                         zero_centered_norm=zero_centered_norm)
        self.pre_feedforward_layernorm = rms_norm(hidden_size, rms_norm_eps, zero_centered_norm)
        self.post_feedforward_layernorm = rms_norm(hidden_size, rms_norm_eps, zero_centered_norm)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.mix(self.input_layernorm(x), cos, sin, document_ids, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
