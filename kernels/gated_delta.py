"""The Gated DeltaNet ops (Qwen3-Next, Qwen3.5): the gated delta rule and the short causal
convolution before it, as plain PyTorch references (a per-step recurrence in fp32).

Both take ``document_ids`` [B, S]: where the id changes, a new document starts with zero
history (the recurrent state and the convolution's window are reset there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over q, k [B, S, H, Dk] (already repeated to v's heads), v [B, S, H,
    Dv], the log decay ``g`` and the write strength ``beta`` [B, S, H]: per step,
    ``S = S * exp(g)``, ``S = S + k (beta (v - S^T k))^T``, ``out = S^T q * scale``.

    ``scale`` defaults to Dk ** -0.5; ``use_qk_l2norm`` L2-normalises q and k first (eps 1e-6
    inside the square root). ``initial_state`` [B, H, Dk, Dv] is the state before position 0
    (of position 0's document); ``document_ids`` [B, S] reset the state to zero where they
    change. Returns (out [B, S, H, Dv] in q's dtype, the state after the last position
    [B, H, Dk, Dv] fp32 when ``output_final_state``, else None)."""
    dtype = q.dtype
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (dk**-0.5 if scale is None else scale)
    state = q.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state.float().clone()
    if document_ids is not None:
        starts = torch.zeros_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        keep = (~starts).float()[:, :, None, None, None]
    out = v.new_empty(batch, seq, heads, dv)
    for t in range(seq):
        if document_ids is not None:
            state = state * keep[:, t]
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        remembered = (state * k_t[..., None]).sum(dim=-2)
        delta = (v[:, t] - remembered) * beta[:, t][..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        out[:, t] = (state * q[:, t][..., None]).sum(dim=-2)
    return out.to(dtype), (state if output_final_state else None)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    document_ids: torch.Tensor | None = None,
    activation: str | None = "silu",
    state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of x [B, S, D] with ``weight`` [D, K]: out[t] = sum_j
    weight[:, j] * x[t - K + 1 + j] (+ bias), then ``activation`` ('silu' or None).

    ``state`` [B, D, K - 1] holds the inputs before position 0 (of position 0's document; zeros
    when None); ``document_ids`` [B, S] give each document zero history at its start. Returns
    (out [B, S, D] in x's dtype, the last K - 1 inputs [B, D, K - 1] as the next call's
    ``state``, zero where they are not of the last position's document, when
    ``output_final_state``, else None)."""
    batch, seq, dim = x.shape
    width = weight.shape[1]
    history = x.new_zeros(batch, width - 1, dim) if state is None else state.transpose(1, 2).to(x.dtype)
    padded = torch.cat([history, x], dim=1)  # [B, K - 1 + S, D]
    if document_ids is not None:
        starts = torch.zeros_like(document_ids, dtype=torch.long)
        starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
        segments = starts.cumsum(dim=1)  # [B, S] index of each position's document run
        source = torch.cat([segments.new_zeros(batch, width - 1), segments], dim=1)  # the history is segment 0's
    windows = padded.unfold(1, width, 1)  # [B, S, D, K]
    if document_ids is not None:
        same = source.unfold(1, width, 1) == segments[..., None]  # [B, S, K]
        windows = windows * same[:, :, None, :].to(windows.dtype)
    out = (windows.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation={activation!r}: expected 'silu' or None")
    final = None
    if output_final_state:
        final = padded[:, seq:]  # [B, K - 1, D]
        if document_ids is not None:
            final = final * (source[:, seq:] == segments[:, -1:])[..., None].to(final.dtype)
        final = final.transpose(1, 2).contiguous()
    return out.to(x.dtype), final
