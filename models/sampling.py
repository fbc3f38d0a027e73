"""What every generation loop shares, beside the KV cache: left-padded prompt batches whose
rows generate what they generate alone, and transformers' top-k / top-p logit filters."""

from __future__ import annotations

import torch


def left_pad(prompts: list[list[int]], max_new_tokens: int, multiple: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Input ids [B, P] (left-padded with 0, P the longest prompt rounded up to a multiple of
    ``multiple``), position ids [B, P + max_new_tokens] starting at 0 at each row's first real
    token, and document ids (pads 0, real tokens 1) of the same shape, or None when no row is
    padded."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = -(-max(len(p) for p in prompts) // multiple) * multiple
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    real = torch.ones(len(prompts), width + max_new_tokens, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        real[i, : width - len(p)] = 0
    positions = (real.cumsum(dim=1) - 1).clamp(min=0)
    padded = any(len(p) < width for p in prompts)
    return ids, positions, real if padded else None


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top k and outside the top-p nucleus set to -inf
    (transformers' TopK then TopP warpers)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
