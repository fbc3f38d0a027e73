"""Reference kernels: the plain PyTorch formulas of the Hugging Face Llama/Qwen2 models.

Slow and memory-hungry on purpose: every other path is tested against these.
Tensor layouts: attention tensors are [batch, heads, seq, head_dim]; cos/sin are
[batch, seq, head_dim] with the two halves repeated (the HF "rotate_half" convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmflow.kernels.masks import attention_mask


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, in transformers' order of operations (Gemma's final-logit
    soft-capping)."""
    return torch.tanh(logits / cap) * cap


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    mask = attention_mask(q.shape[2], k.shape[2], q.device, document_ids, sliding_window, query_start)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(probs.to(q.dtype), v)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    if softcap is not None:
        logits = soft_cap(logits, softcap)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row groups of ``x`` [N, in] (``counts`` [E] rows each, in expert order) times each
    expert's ``weight[e]`` [out, in], transposed as nn.Linear does: [N, out]."""
    groups = x.split(counts.tolist())
    return torch.cat([group @ weight[e].t() for e, group in enumerate(groups)])
