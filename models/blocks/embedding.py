"""The token embedding of a family that scales it (Gemma: by sqrt(hidden_size))."""

from __future__ import annotations

import torch
from torch import nn


def rounded_scales(scale: float) -> dict[torch.dtype, float]:
    """``scale`` as transformers holds it in each floating dtype: an fp32 tensor cast to the
    embedding's dtype (bf16 makes sqrt(3072) = 55.43 55.5). Computed once, on the CPU, whatever
    device the model is built on, so that no forward calls torch for it."""
    return {dtype: torch.tensor(scale, dtype=torch.float32, device="cpu").to(dtype).item()
            for dtype in (torch.float32, torch.bfloat16, torch.float16)}


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by ``scale`` rounded to the weight's dtype, the
    dtype it computes in (bf16 under mixed precision), as transformers' Gemma3TextScaledWordEmbedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float, padding_idx: int | None = None,
                 _weight: torch.Tensor | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, _weight=_weight)
        self.scale = scale
        self.scales = rounded_scales(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scales[self.weight.dtype]
