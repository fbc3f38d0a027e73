"""The decoder every family shares, in plain PyTorch: embedding, the family's layers (built
by its ``build_layer``, ``models/families``), final norm and output projection.

Module and parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``),
so weights, LoRA target names and precision dumps line up with the HF ecosystem. Layers
live in a ModuleDict keyed "0", "1", ...: a model holding only some of the layers keeps their
names. ``embed_tokens``, ``norm`` and ``lm_head`` may be None, as in a pipeline stage; forward
takes token ids (embedded) or hidden states (floating point: a later stage's input, never
embedded) and returns logits or, without ``lm_head``, hidden states. Parallelism is applied
from outside (``models/parallelize.py``, ``models/pipeline.py``), never here.

Generation passes a ``KVCache``: each attention layer appends its new keys and values to
preallocated buffers and its queries attend over every cached position; each Gated DeltaNet
layer replaces its convolution and recurrent states. Training passes none and runs exactly
as without it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.biased_moe import ClampedSwiGLUExperts
from llmflow.models.blocks.embedding import ScaledEmbedding
from llmflow.models.blocks.gated_deltanet import GatedDeltaNet, init_a_log
from llmflow.models.blocks.moe import GroupedExperts, TopKRouter
from llmflow.models.blocks.moe_routing import GroupLimitedRouter
from llmflow.models.blocks.norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm, rms_norm
from llmflow.models.blocks.rotary import (
    inverse_frequencies,
    positions_from_documents,
    rotary_attention_factor,
    rotary_cos_sin,
)
from llmflow.models.config import ModelConfig, family_of
from llmflow.models.kv_cache import KVCache


def embedding_weight(rows: int, dim: int) -> torch.Tensor:
    """nn.Embedding's initial weight, normal(0, 1); left empty on the meta device, where
    normal_ would import torch._dynamo (seconds of every model load)."""
    weight = torch.empty(rows, dim)
    return weight if weight.is_meta else nn.init.normal_(weight)


def sliding_inverse_frequencies(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor | None:
    """inv_freq of the 'sliding_attention' layers where they rotate by a base of their own,
    unscaled (Gemma 3's ``rope_local_base_freq``); None where every layer rotates alike."""
    if config.sliding_rope_theta is None:
        return None
    local = dataclasses.replace(config, rope_theta=config.sliding_rope_theta, rope_scaling=None)
    return inverse_frequencies(local, device=device)


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: HF's ``model`` submodule."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rows, dim, padding = config.vocab_size, config.hidden_size, config.embedding_padding_idx
        weight = embedding_weight(rows, dim)
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(rows, dim, padding_idx=padding, _weight=weight) if config.embedding_scale is None
            else ScaledEmbedding(rows, dim, config.embedding_scale, padding, _weight=weight))
        build_layer = family_of(config.model_type).build_layer
        self.layers = nn.ModuleDict({str(i): build_layer(config, i) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | ZeroCenteredRMSNorm | None = rms_norm(
            config.hidden_size, config.rms_norm_eps, config.zero_centered_norms)
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self.register_buffer("sliding_inv_freq", sliding_inverse_frequencies(config), persistent=False)
        self.rotary_scale = rotary_attention_factor(config)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the rotary frequencies (after the model left the meta device)."""
        device = device or self.inv_freq.device
        self.inv_freq = inverse_frequencies(self.config, device=device)
        self.sliding_inv_freq = sliding_inverse_frequencies(self.config, device=device)

    def forward(
        self,
        tokens_or_hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """With ``kv_cache``, the input holds the positions after the cached ones: positions
        default to continuing from them, and ``document_ids`` are the new positions' ids."""
        embed = self.embed_tokens is not None and not tokens_or_hidden.is_floating_point()
        h = self.embed_tokens(tokens_or_hidden) if embed else tokens_or_hidden
        batch, seq = tokens_or_hidden.shape[:2]  # h may hold a sequence shard (sequence parallel)
        if position_ids is None:
            if document_ids is not None and kv_cache is None:
                position_ids = positions_from_documents(document_ids)
            else:
                start = kv_cache.filled if kv_cache is not None else 0
                position_ids = torch.arange(start, start + seq, device=h.device).expand(batch, seq)
        shared = rotary_cos_sin(self.inv_freq, position_ids, h.dtype, self.rotary_scale)
        sliding = shared if self.sliding_inv_freq is None else rotary_cos_sin(self.sliding_inv_freq, position_ids,
                                                                              h.dtype)
        if kv_cache is not None:
            document_ids = kv_cache.documents(document_ids)
        for name, layer in self.layers.items():
            cos, sin = sliding if self.config.is_sliding_layer(int(name)) else shared
            h = layer(h, cos, sin, document_ids, (kv_cache, name) if kv_cache is not None else None)
        if kv_cache is not None:
            kv_cache.advance(seq)
        return self.norm(h) if self.norm is not None else h


class CausalLM(nn.Module):
    """Decoder plus output projection: HF's ``*ForCausalLM``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        loss_reduction: str = "mean",
        kv_cache: KVCache | None = None,
        temperature: float = 1.0,
        logits_to_keep: int = 0,
        return_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, S, vocab], or the cross-entropy loss when ``labels`` is given: the mean
        or sum over target tokens (``loss_reduction``), or with "none" every token's [B, S]
        (0 where no loss is taken). Both are of the logits (soft-capped where the config caps
        them) divided by ``temperature`` (an
        online RL objective scores its samples so); ``logits_to_keep`` > 0 returns the logits
        of the last that many positions only (generation). ``return_entropy`` with
        ``loss_reduction="none"`` returns every token's loss and the entropy of its predicted
        distribution (a metric, without gradient).

        ``labels`` [B, S] are the targets of each position (already shifted: labels[:, i]
        is the token after input_ids[:, i]), -100 where no loss is taken. The loss path
        never materialises the logits of the whole batch. ``document_ids`` [B, S] marks
        packed documents: attention stays inside a document and positions restart.
        ``kv_cache`` (generation) holds the earlier positions; see ``DecoderModel.forward``.
        """
        h = self.model(input_ids, position_ids, document_ids, kv_cache)
        if self.lm_head is None:
            return h
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        softcap = self.config.final_logit_softcapping
        if temperature != 1.0:  # the output projection has no bias: (h / t) W^T = logits / t
            h = h / temperature
            if softcap is not None:  # c tanh(z / c) / t = (c / t) tanh((z / t) / (c / t))
                softcap = softcap / temperature
        real = self.config.unpadded_vocab_size
        if labels is None:
            logits = self.lm_head(h)
            if softcap is not None:
                logits = kernels.soft_cap(logits, softcap)
            return logits if real is None else logits[..., :real]
        weight = self.lm_head.weight if real is None else self.lm_head.weight[:real]
        rows, targets = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        if return_entropy:
            loss, entropy = kernels.token_cross_entropy(rows, weight, targets, softcap=softcap)
            return loss.view(labels.shape).clone(), entropy.view(labels.shape)
        loss = kernels.linear_cross_entropy(rows, weight, targets, reduction=loss_reduction, softcap=softcap)
        if loss_reduction != "none":
            return loss
        return loss.view(labels.shape).clone()  # a fresh tensor, not a view: FSDP2 hooks its module's output for backward

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random initialisation for training from scratch: normal(0, std) weights (the
        experts', routers' and convolutions' too), unit norms (zero where stored
        zero-centred), zero biases (a router's correction bias and the experts' too) and the embedding's padding
        row; a Gated DeltaNet's ``dt_bias`` ones and ``A_log`` as transformers draws it."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, TopKRouter, GroupLimitedRouter)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if isinstance(module, GroupLimitedRouter):
                    module.e_score_correction_bias.zero_()
            elif isinstance(module, GroupedExperts):
                for weight in module.parameters():
                    weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, ClampedSwiGLUExperts):
                for weight in (module.gate_up_weight, module.down_weight):
                    weight.normal_(0.0, std, generator=generator)
                module.gate_up_bias.zero_()
                module.down_bias.zero_()
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                module.weight.fill_(1.0)
            elif isinstance(module, ZeroCenteredRMSNorm):
                module.weight.zero_()
            elif isinstance(module, GatedDeltaNet):
                module.conv1d.weight.normal_(0.0, std, generator=generator)
                module.dt_bias.fill_(1.0)
                init_a_log(module.A_log, generator)
        embed = self.model.embed_tokens
        if embed is not None and embed.padding_idx is not None:  # zero, as nn.Embedding starts it (a tied head too)
            embed.weight[embed.padding_idx].zero_()
        self.model.reset_rope()
