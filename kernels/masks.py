"""Attention masks shared by every attention path (True = the query may attend the key)."""

from __future__ import annotations

import torch


def attention_mask(
    q_len: int,
    kv_len: int,
    device: torch.device,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [B or 1, 1, q_len, kv_len]: causal, restricted to the same document when
    ``document_ids`` [B, kv_len] is given, and to the last ``sliding_window`` keys when that is
    set. The queries are the last ``q_len`` of the ``kv_len`` positions, or, with
    ``query_start`` (a 0-d tensor: a static KV cache's write position), the ``q_len`` from
    there, the keys after them not yet written."""
    if query_start is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    else:
        q_pos = torch.arange(q_len, device=device) + query_start
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos < sliding_window)
    mask = mask[None, None]
    if document_ids is not None:
        query_docs = document_ids[:, -q_len:] if query_start is None else document_ids.index_select(1, q_pos)
        same_doc = query_docs[:, :, None] == document_ids[:, None, :]
        mask = mask & same_doc[:, None]
    return mask


def needs_explicit_mask(
    q_len: int, kv_len: int, document_ids: torch.Tensor | None, sliding_window: int | None,
    query_start: torch.Tensor | None = None,
) -> bool:
    """False when plain top-left causal masking (or none, for a single decode step) is exact."""
    if document_ids is not None or query_start is not None:
        return True
    if sliding_window is not None and kv_len > sliding_window:
        return True
    return q_len != kv_len and q_len != 1
