"""The Llama/Qwen2-family decoder in plain PyTorch.

Module and parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``),
so weights, LoRA target names and precision dumps line up with the HF ecosystem. Layers
live in a ModuleDict keyed "0", "1", ...: a model holding only some of the layers keeps their
names. ``embed_tokens``, ``norm`` and ``lm_head`` may be None, as in a pipeline stage; forward
takes token ids (embedded) or hidden states (floating point: a later stage's input, never
embedded) and returns logits or, without ``lm_head``, hidden states. Parallelism is applied
from outside (``models/parallelize.py``, ``models/pipeline.py``), never here.

Shapes are read from the weights at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that shards heads needs no change to this file.

Generation passes a ``KVCache``: each attention layer appends its new keys and values to
preallocated buffers and its queries attend over every cached position. Training passes
none and runs exactly as without it.
"""

from __future__ import annotations

import torch
from torch import nn

from llmflow import kernels
from llmflow.models.config import ModelConfig
from llmflow.models.rope import (
    inverse_frequencies,
    positions_from_documents,
    rotary_cos_sin,
)


class KVCache:
    """Keys and values of the positions processed so far, in buffers [B, Hkv, max_len, D]
    allocated on each layer's first write (so their shapes follow the weights, sharded or
    not), plus the keys' document ids when the batch has any (left padding as a document of
    its own keeps pad positions out of every real token's attention)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.filled = 0
        """Positions already written by every layer."""
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}
        self._documents: torch.Tensor | None = None

    def documents(self, document_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Store the new positions' document ids [B, S]; the ids of every key up to them."""
        if document_ids is None:
            return None
        if self._documents is None:
            self._documents = document_ids.new_zeros(document_ids.shape[0], self.max_len)
        end = self.filled + document_ids.shape[1]
        self._documents[:, self.filled : end] = document_ids
        return self._documents[:, :end]

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v [B, Hkv, S, D] of ``layer``; its keys and values up to them."""
        if layer not in self._keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self._keys[layer], self._values[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.filled + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot hold {end}")
        self._keys[layer][:, :, self.filled : end] = k
        self._values[layer][:, :, self.filled : end] = v
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def repeat(self, batch: int, max_len: int) -> KVCache:
        """A cache of ``batch`` rows with room for ``max_len`` positions, each row starting
        with this one-row cache's positions (a prompt prefix computed once, shared by a batch)."""
        out = KVCache(max_len)
        for layer in self._keys:
            keys, values = self._keys[layer][:, :, : self.filled], self._values[layer][:, :, : self.filled]
            out.update(layer, keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1))
        if self._documents is not None:
            out.documents(self._documents[:, : self.filled].expand(batch, -1))
        out.filled = self.filled
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd
        self.scale = hd**-0.5
        self.sliding_window = config.sliding_window
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q = kernels.apply_rotary(q, cos, sin)
        k = kernels.apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache[0].update(cache[1], k, v)
        out = kernels.attention(q, k, v, self.scale, document_ids, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        # Tensor-parallel plans give self_attn fixed input layouts: pass a cache only when there is one.
        cached = (cache,) if cache is not None else ()
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, document_ids, *cached)
        return x + self.mlp(self.post_attention_layernorm(x))


def embedding_weight(rows: int, dim: int) -> torch.Tensor:
    """nn.Embedding's initial weight, normal(0, 1); left empty on the meta device, where
    normal_ would import torch._dynamo (seconds of every model load)."""
    weight = torch.empty(rows, dim)
    return weight if weight.is_meta else nn.init.normal_(weight)


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: HF's ``model`` submodule."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=embedding_weight(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the rotary frequencies (after the model left the meta device)."""
        self.inv_freq = inverse_frequencies(self.config, device=device or self.inv_freq.device)

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
        start = kv_cache.filled if kv_cache is not None else 0
        if position_ids is None:
            if document_ids is not None and kv_cache is None:
                position_ids = positions_from_documents(document_ids)
            else:
                position_ids = torch.arange(start, start + seq, device=h.device).expand(batch, seq)
        cos, sin = rotary_cos_sin(self.inv_freq, position_ids, h.dtype)
        if kv_cache is not None:
            document_ids = kv_cache.documents(document_ids)
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, document_ids, (kv_cache, name) if kv_cache is not None else None)
        if kv_cache is not None:
            kv_cache.filled += seq
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
    ) -> torch.Tensor:
        """Logits [B, S, vocab], or the cross-entropy loss when ``labels`` is given.

        ``labels`` [B, S] are the targets of each position (already shifted: labels[:, i]
        is the token after input_ids[:, i]), -100 where no loss is taken. The loss path
        never materialises the logits of the whole batch. ``document_ids`` [B, S] marks
        packed documents: attention stays inside a document and positions restart.
        ``kv_cache`` (generation) holds the earlier positions; see ``DecoderModel.forward``.
        """
        h = self.model(input_ids, position_ids, document_ids, kv_cache)
        if self.lm_head is None:
            return h
        real = self.config.unpadded_vocab_size
        if labels is None:
            logits = self.lm_head(h)
            return logits if real is None else logits[..., :real]
        weight = self.lm_head.weight if real is None else self.lm_head.weight[:real]
        return kernels.linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), reduction=loss_reduction)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random initialisation for training from scratch: normal(0, std) weights, unit
        norms, zero biases."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        self.model.reset_rope()
