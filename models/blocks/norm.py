"""RMSNorm, the normalisation of every family's layers and final norm; its zero-centred
variant and the gated RMSNorm of Gated DeltaNet layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmflow import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored zero-centred: applied as ``(1 + weight)``, in fp32, cast
    back afterwards (Qwen3-Next, Qwen3.5: their layer, q/k and final norms; initialised to 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * weight * silu(gate)`` over the last dim (the output norm of a Gated
    DeltaNet head, gated by its ``z`` projection); weight stored as is (initialised to 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def rms_norm(dim: int, eps: float, zero_centered: bool = False) -> RMSNorm | ZeroCenteredRMSNorm:
    """The RMSNorm a family's config asks for: stored zero-centred or as is."""
    return ZeroCenteredRMSNorm(dim, eps) if zero_centered else RMSNorm(dim, eps)
