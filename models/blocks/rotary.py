"""Rotary position embedding frequencies, including the scaling types Llama 3 uses, over
all of each head or its first ``partial_rotary_factor`` part."""

from __future__ import annotations

import math

import torch

from llmflow.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """inv_freq [rotary_dim // 2] in fp32, computed exactly as transformers does; the rotary
    dims are ``int(head_dim * partial_rotary_factor)`` (all of them unless a family rotates
    only part of each head)."""
    dim = int(config.head_dim * config.partial_rotary_factor)
    if torch.empty(0, device=device).is_meta:  # shape only: arithmetic on meta imports torch._dynamo (seconds)
        return torch.empty(dim // 2, device=device)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by ``factor``,
    short ones kept, a smooth blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, S, rotary_dim] for ``position_ids`` [B, S] (halves repeated)."""
    freqs = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] that restart at 0 where each packed document begins."""
    seq = document_ids.shape[1]
    idx = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx
