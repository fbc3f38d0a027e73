"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear-attention layers
(``linear_attn``) and gated full-attention layers (``self_attn``, every fourth by default:
``layer_types``, else ``full_attention_interval``), with a mixture of experts and a shared
expert on the layers ``mlp_only_layers``/``decoder_sparse_step`` leave sparse (a dense MLP
everywhere when ``num_experts`` is 0).

Its attention's ``q_proj`` emits each head's queries and as many gate values (the output is
scaled by their sigmoid), rotary turns the first ``partial_rotary_factor`` (0.25) of each
head, and q/k, layer and final RMSNorms store their weights zero-centred, applied as
(1 + w). The Gated DeltaNet fuses its projections into ``in_proj_qkvz`` and ``in_proj_ba``.
The Hub's checkpoints store one tensor per expert (``mlp.experts.{i}.gate_proj.weight``), as
transformers saves them (the fused layout transformers also reads is read too), and the
multi-token prediction layers (``mtp.*``), which are left out.

The helpers here are Qwen3.5's too (``qwen3_5.py``): the same layers, with the DeltaNet's
projections apart.
"""

from __future__ import annotations

from typing import Any

from llmflow.models.blocks.attention import Attention
from llmflow.models.blocks.decoder_layer import DecoderLayer
from llmflow.models.blocks.gated_deltanet import GatedDeltaNet
from llmflow.models.config import LAYER_TYPES, ConfigError, Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.moe_options import read_experts, write_experts

# Qwen3NextConfig's (and Qwen3.5's) defaults for keys a config.json may leave out.
DEFAULT_HEAD_DIM = 256
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
MTP = ("mtp.", "the multi-token prediction layers")


def read_hybrid(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The keys Qwen3-Next and Qwen3.5 share: layer types, the Gated DeltaNet's shape, the
    gated attention with zero-centred q/k norms and partial rotary."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"{source}: layer_types {unknown} are not supported; expected {LAYER_TYPES}")
    if len(types) != layers:
        raise ConfigError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    linear = {key: hf.get(key, default) for key, default in LINEAR_DEFAULTS.items()}
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise ConfigError(f"{source}: linear_num_value_heads={linear['linear_num_value_heads']} is not a multiple "
                          f"of linear_num_key_heads={linear['linear_num_key_heads']}")
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    bias = bool(hf.get("attention_bias", False))
    return {"head_dim": hf.get("head_dim") or DEFAULT_HEAD_DIM, "qkv_bias": bias, "o_bias": bias, "mlp_bias": False,
            "qk_norm": True, "sliding_window": None, "layer_types": tuple(types), **linear,
            "partial_rotary_factor": float(partial), "attention_output_gate": True, "zero_centered_norms": True}


def write_hybrid(config: ModelConfig) -> dict[str, Any]:
    linear = {key: getattr(config, key) for key in LINEAR_DEFAULTS}
    return {"attention_bias": config.qkv_bias, **linear}


def read_moe(hf: dict[str, Any], source: str, *, every_layer: bool, norm_topk_prob: bool | None = None) -> dict[str, Any]:
    """The routed and shared experts (``num_experts``, default 512 as Qwen3NextConfig); on
    every layer when ``every_layer`` (Qwen3.5-MoE), else where ``mlp_only_layers`` and
    ``decoder_sparse_step`` route."""
    experts = read_experts({"num_experts": 512, **hf}, source, ("num_experts",))
    if every_layer:
        experts["dense_layers"] = ()
    return {**experts, "moe_intermediate_size": hf.get("moe_intermediate_size", 512),
            "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 512),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)) if norm_topk_prob is None else norm_topk_prob}


def write_moe(config: ModelConfig, norm_topk_prob: bool = True) -> dict[str, Any]:
    keys = {"moe_intermediate_size": config.moe_intermediate_size,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            **write_experts("num_experts", config)}
    return {**keys, "norm_topk_prob": config.norm_topk_prob} if norm_topk_prob else keys


def build_hybrid_layer(config: ModelConfig, index: int, fused_projections: bool) -> DecoderLayer:
    if config.is_linear_layer(index):
        mixer = GatedDeltaNet(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                              config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                              config.rms_norm_eps, fused_projections=fused_projections)
        name = "linear_attn"
    else:
        mixer = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                          qkv_bias=config.qkv_bias, o_bias=config.o_bias, qk_norm_eps=config.rms_norm_eps,
                          zero_centered_norm=config.zero_centered_norms, output_gate=config.attention_output_gate)
        name = "self_attn"
    return DecoderLayer(config.hidden_size, config.rms_norm_eps, mixer, llama.build_feed_forward(config, index),
                        mixer_name=name, zero_centered_norm=config.zero_centered_norms)


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    moe = read_moe(hf, source, every_layer=False) if hf.get("num_experts", 512) else {}
    return {**read_hybrid(hf, source), **moe}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {**write_hybrid(config), **(write_moe(config) if config.num_experts else {})}


def build_layer(config: ModelConfig, index: int) -> DecoderLayer:
    return build_hybrid_layer(config, index, fused_projections=True)


QWEN3_NEXT = Family("qwen3_next", read_options, build_layer, "Qwen3NextForCausalLM", write_options, hf_left_out=(MTP,))
