"""Llama 2/3: pre-norm layers of grouped-query attention and a SwiGLU MLP, biases only
where config.json's ``attention_bias`` asks for them.

``build_layer`` is also the layer of the families that differ from Llama only in their
config.json (Mistral, Qwen2, Qwen3 and the mixture-of-experts families, whose feed-forward
block is a ``MoE`` on the layers their config routes).
"""

from __future__ import annotations

from typing import Any

from llmflow.models.blocks.attention import Attention
from llmflow.models.blocks.decoder_layer import DecoderLayer
from llmflow.models.blocks.mlp import MLP
from llmflow.models.blocks.moe import MoE
from llmflow.models.config import Family, ModelConfig
from llmflow.models.families.moe_options import build_router


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}


def build_layer(config: ModelConfig, index: int) -> DecoderLayer:
    attention = Attention(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        qkv_bias=config.qkv_bias,
        o_bias=config.o_bias,
        sliding_window=config.sliding_window,
        qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
    )
    return DecoderLayer(config.hidden_size, config.rms_norm_eps, attention, build_feed_forward(config, index))


def build_feed_forward(config: ModelConfig, index: int) -> MLP | MoE:
    if config.is_moe_layer(index):
        return MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                   config.norm_topk_prob, config.shared_expert_intermediate_size,
                   shared_expert_gated=config.shared_expert_gated, router=build_router(config))
    return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


LLAMA = Family("llama", read_options, build_layer, "LlamaForCausalLM", write_options)
