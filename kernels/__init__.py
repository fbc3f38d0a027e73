"""Fused ops of the decoder, each with a reference, a fused-torch (CPU/CUDA) and an NPU
implementation. The functions here dispatch on the input's device type."""

from __future__ import annotations

import torch

from llmflow.kernels.dispatch import FUSED, REFERENCE, KernelSet, kernels_for, use_kernels
from llmflow.kernels.gated_delta import causal_conv1d, gated_delta_rule

__all__ = [
    "FUSED",
    "REFERENCE",
    "KernelSet",
    "apply_rotary",
    "attention",
    "causal_conv1d",
    "gated_delta_rule",
    "grouped_mm",
    "kernels_for",
    "linear_cross_entropy",
    "rms_norm",
    "swiglu",
    "use_kernels",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalised in fp32 as HF Llama/Qwen2 do."""
    return kernels_for(x.device.type).rms_norm(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, S, D] with cos/sin [B, S, D] (rotate-half convention)."""
    return kernels_for(x.device.type).apply_rotary(x, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return kernels_for(gate.device.type).swiglu(gate, up)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention, q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D] with Hq a multiple of Hkv
    (GQA). Queries are the last Sq positions. ``document_ids`` [B, Skv] keeps packed
    documents apart; ``sliding_window`` limits how far back a query looks."""
    return kernels_for(q.device.type).attention(q, k, v, scale, document_ids, sliding_window)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts' matmul: ``x`` [N, in] holds ``counts[e]`` rows for each expert e in
    order, each multiplied by its ``weight[e]`` [out, in] as nn.Linear does; [N, out]."""
    return kernels_for(x.device.type).grouped_mm(x, weight, counts)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against labels; the fused paths never hold
    the logits of all tokens at once. A tensor-parallel run passes the output projection as
    a replicated DTensor; every rank then computes the same loss on its full copy."""
    weight = _replicated_local(weight)
    return kernels_for(hidden.device.type).linear_cross_entropy(hidden, weight, labels, ignore_index, reduction)


def _replicated_local(weight: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return weight
    if not all(p.is_replicate() for p in weight.placements):
        raise NotImplementedError(f"the fused cross-entropy needs a replicated output projection, got {weight.placements}")
    return weight.to_local()
