"""Attention masks shared by every attention path (True = the query may attend the key)."""

from __future__ import annotations

import torch


def attention_mask(
    q_len: int,
    kv_len: int,
    device: torch.device,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean mask [B or 1, 1, q_len, kv_len]: causal (queries are the last ``q_len`` of the
    ``kv_len`` positions), restricted to the same document when ``document_ids`` [B, kv_len]
    is given, and to the last ``sliding_window`` keys when that is set."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    mask = mask[None, None]
    if document_ids is not None:
        same_doc = document_ids[:, -q_len:, None] == document_ids[:, None, :]
        mask = mask & same_doc[:, None]
    return mask


def needs_explicit_mask(
    q_len: int, kv_len: int, document_ids: torch.Tensor | None, sliding_window: int | None
) -> bool:
    """False when plain top-left causal masking (or none, for a single decode step) is exact."""
    if document_ids is not None:
        return True
    if sliding_window is not None and kv_len > sliding_window:
        return True
    return q_len != kv_len and q_len != 1
