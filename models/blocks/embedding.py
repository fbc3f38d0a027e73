"""The token embedding of a family that scales it (Gemma: by sqrt(hidden_size))."""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def _rounded(scale: float, dtype: torch.dtype) -> float:
    """``scale`` as transformers holds it: an fp32 tensor cast to the embedding's dtype (bf16
    makes sqrt(3072) = 55.43 55.5)."""
    return torch.tensor(scale, dtype=torch.float32).to(dtype).item()


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by ``scale`` rounded to the weight's dtype, the
    dtype it computes in (bf16 under mixed precision), as transformers' Gemma3TextScaledWordEmbedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float, padding_idx: int | None = None,
                 _weight: torch.Tensor | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, _weight=_weight)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * _rounded(self.scale, self.weight.dtype)
