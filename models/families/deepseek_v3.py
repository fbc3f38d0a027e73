"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): Multi-head Latent Attention in every layer
(``self_attn``, ``models/blocks/mla.py``), usually with YaRN rotary scaling, a dense SwiGLU MLP
on the first ``first_k_dense_replace`` layers and DeepSeek's mixture of experts on the others
(``moe_options.read_sigmoid_routing``: the sigmoid router with ``e_score_correction_bias`` and
groups, ungated ``shared_experts``). A model whose every layer is dense has no experts at all.

Kimi K2 (``moonshotai/Kimi-K2-*``) is this architecture under ``model_type: kimi_k2`` (its
config.json's ``architectures`` is ``DeepseekV3ForCausalLM``, its config class remote code):
``KIMI_K2`` reads it as DeepSeek-V3 and writes ``kimi_k2`` back on export.

The Hub's checkpoints hold the multi-token prediction layer as the layer after the last one
(``model.layers.{num_hidden_layers}``), which is left out, as transformers leaves it out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llmflow.models.blocks.decoder_layer import DecoderLayer
from llmflow.models.blocks.mla import MultiHeadLatentAttention
from llmflow.models.blocks.rotary import yarn_mscale
from llmflow.models.config import ConfigError, Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.moe_options import read_sigmoid_routing, write_sigmoid_routing

MLA_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128}
"""DeepseekV3Config's defaults for the attention keys a config.json may leave out."""
ROUTING_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 3,
                    "moe_intermediate_size": 2048, "norm_topk_prob": True}
"""DeepseekV3Config's defaults for the routing keys."""
MTP = "the multi-token prediction layer"


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    dense = hf.get("first_k_dense_replace", ROUTING_DEFAULTS["first_k_dense_replace"])
    if isinstance(dense, bool) or not isinstance(dense, int):
        raise ConfigError(f"{source}: first_k_dense_replace={dense!r}; expected a number of layers")
    if hf.get("moe_layer_freq", 1) != 1:  # DeepSeek's own code routes every n-th layer; transformers every layer
        raise ConfigError(f"{source}: moe_layer_freq={hf['moe_layer_freq']!r} is not supported; every layer from "
                          "first_k_dense_replace on is a mixture of experts (moe_layer_freq=1)")
    experts = read_sigmoid_routing(hf, source, ROUTING_DEFAULTS) if dense < layers else {}
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(f"{source}: num_key_value_heads={kv_heads} differs from num_attention_heads={heads}; "
                          "Multi-head Latent Attention expands keys and values for every query head")
    sizes = {key: hf.get(key, default) for key, default in MLA_DEFAULTS.items()}
    for key, value in sizes.items():
        if (value is not None or key != "q_lora_rank") and (isinstance(value, bool) or not isinstance(value, int)
                                                             or value < 1):
            raise ConfigError(f"{source}: {key}={value!r}; expected a positive width")
    bias = bool(hf.get("attention_bias", False))
    return {**sizes, "num_key_value_heads": heads, "head_dim": sizes["qk_rope_head_dim"],
            "rope_interleave": bool(hf.get("rope_interleave", True)), "qkv_bias": bias, "o_bias": bias,
            "mlp_bias": False, "sliding_window": None, **experts}


def write_options(config: ModelConfig) -> dict[str, Any]:
    attention = {**{key: getattr(config, key) for key in MLA_DEFAULTS}, "rope_interleave": config.rope_interleave,
                 "attention_bias": config.qkv_bias}
    return {**attention, **(write_sigmoid_routing(config) if config.num_experts else {})}


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim) squared when the rotary scaling
    has an ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def build_layer(config: ModelConfig, index: int) -> DecoderLayer:
    attention = MultiHeadLatentAttention(
        config.hidden_size,
        config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        scale=softmax_scale(config),
        bias=config.qkv_bias,
        rope_interleave=config.rope_interleave,
    )
    return DecoderLayer(config.hidden_size, config.rms_norm_eps, attention, llama.build_feed_forward(config, index))


DEEPSEEK_V3 = Family("deepseek_v3", read_options, build_layer, "DeepseekV3ForCausalLM", write_options,
                     hf_extra_layers=MTP)
KIMI_K2 = dataclasses.replace(DEEPSEEK_V3, model_type="kimi_k2")
"""Kimi K2's config.json: DeepSeek-V3's keys (384 experts in one group, one dense layer)."""
