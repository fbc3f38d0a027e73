"""Rotary position embedding frequencies, including the scaling types Llama 3 and YaRN
(DeepSeek-V3) use, over all of each head or its first ``partial_rotary_factor`` part."""

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
    theta_powers = config.rope_theta**exponents
    inv_freq = 1.0 / theta_powers
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif config.rope_type == "yarn":
        inv_freq = _yarn_scaling(theta_powers, dim, config.rope_theta, scaling)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor`` times longer: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_attention_factor(config: ModelConfig) -> float:
    """What transformers multiplies cos and sin by: YaRN's ``attention_factor`` (given, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
    mscale(factor)); 1 for every other rope type."""
    if config.rope_type != "yarn":
        return 1.0
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_scaling(theta_powers: torch.Tensor, dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies: those that turn fewer than ``beta_slow`` times over the original
    context divided by ``factor`` (interpolated), those that turn more than ``beta_fast`` times
    kept (extrapolated), a linear ramp between; in transformers' order of operations."""
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.arange(dim // 2, dtype=torch.float32, device=theta_powers.device)
    extrapolation = 1 - torch.clamp((ramp - low) / (high - low), 0, 1)
    interpolated = 1.0 / (factor * theta_powers)
    return interpolated * (1 - extrapolation) + (1.0 / theta_powers) * extrapolation


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
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, S, rotary_dim] for ``position_ids`` [B, S] (halves repeated), times
    ``scale`` (``rotary_attention_factor``) in fp32."""
    freqs = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] that restart at 0 where each packed document begins."""
    seq = document_ids.shape[1]
    idx = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx
