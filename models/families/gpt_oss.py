"""gpt-oss (gpt-oss-20b, gpt-oss-120b; transformers' ``GptOssForCausalLM``): pre-norm layers of
grouped-query attention with biases on q/k/v/o and a learned sink logit per head
(``self_attn.sinks``), alternating sliding-window (``sliding_window``, 128) and full layers
(``layer_types``, else sliding on even layers as ``GptOssConfig`` makes them), YaRN rotary, and
a mixture of experts on every layer: the router (``mlp.router``, weight and bias) takes each
token's k largest logits and their softmax as weights, and the experts (``mlp.experts``, with
biases, [in, out] per expert) compute a clamped SwiGLU of interleaved gate/up columns
(``swiglu_alpha``, ``swiglu_limit``). The experts of the published checkpoints are stored
MXFP4 (``_blocks``/``_scales``), decoded at load by ``llmflow/weights/quantized.py``.

Under tensor parallelism the sinks are split with the heads; expert parallelism splits the
experts' biases with their weights; context parallelism adds each head's sink to its queries'
softmax under both algorithms. Refused: layer types other than sliding/full, sliding layers
without a window, and a ``swiglu_alpha``/``swiglu_limit`` that is not a number.
"""

from __future__ import annotations

from typing import Any

from llmflow.models.blocks.attention import Attention
from llmflow.models.blocks.biased_moe import BiasedTopKRouter, ClampedSwiGLUExperts
from llmflow.models.blocks.decoder_layer import DecoderLayer
from llmflow.models.blocks.moe import MoE
from llmflow.models.config import ConfigError, Family, ModelConfig
from llmflow.models.families.gemma3 import read_layer_types
from llmflow.models.families.moe_options import read_experts, write_experts

# GptOssConfig's defaults for keys a config.json may leave out.
DEFAULTS = {"sliding_window": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131_072, "attention_bias": True,
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "num_experts_per_tok": 4}
SLIDING_EVERY = 2
"""GptOssConfig's default ``layer_types``: sliding on layers 0, 2, 4, ..., full on the others."""
HF_RENAMES = (
    (".mlp.gate.", ".mlp.router."),
    # The bias pairs first: each replacement must not rewrite the other's name.
    (".experts.gate_up_bias", ".experts.gate_up_proj_bias"), (".experts.gate_up_weight", ".experts.gate_up_proj"),
    (".experts.down_bias", ".experts.down_proj_bias"), (".experts.down_weight", ".experts.down_proj"),
)
"""Our names of the router and of the experts' tensors (unlike ``GroupedExperts``' stacked
projections, never split per expert) and the checkpoint's."""


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    types = read_layer_types({"sliding_window_pattern": SLIDING_EVERY, **hf}, source)
    window = hf.get("sliding_window", DEFAULTS["sliding_window"])
    if window is None and "sliding_attention" in types:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")
    for key in ("swiglu_alpha", "swiglu_limit"):
        value = hf.get(key, DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}={value!r}; gpt-oss's experts need a number")
    if "intermediate_size" not in hf:
        raise ConfigError(f"{source}: missing required key 'intermediate_size' (the width of one expert)")
    bias = bool(hf.get("attention_bias", DEFAULTS["attention_bias"]))
    experts = read_experts({"num_experts_per_tok": DEFAULTS["num_experts_per_tok"], **hf}, source,
                           ("num_local_experts", "num_experts"))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "layer_types": types, "sliding_window": window,
            "rms_norm_eps": hf.get("rms_norm_eps", DEFAULTS["rms_norm_eps"]),
            "max_position_embeddings": hf.get("max_position_embeddings", DEFAULTS["max_position_embeddings"]),
            "moe_intermediate_size": hf["intermediate_size"], **experts, "dense_layers": (),
            "attention_sinks": True, "biased_experts": True,
            "expert_swiglu_alpha": float(hf.get("swiglu_alpha", DEFAULTS["swiglu_alpha"])),
            "expert_swiglu_limit": float(hf.get("swiglu_limit", DEFAULTS["swiglu_limit"])),
            "embedding_padding_idx": hf.get("pad_token_id")}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "intermediate_size": config.moe_intermediate_size,
            "swiglu_alpha": config.expert_swiglu_alpha, "swiglu_limit": config.expert_swiglu_limit,
            **write_experts("num_local_experts", config)}


def build_layer(config: ModelConfig, index: int) -> DecoderLayer:
    attention = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                          qkv_bias=config.qkv_bias, o_bias=config.o_bias, sliding_window=config.layer_window(index),
                          sinks=config.attention_sinks)
    hidden, width, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
    router = BiasedTopKRouter(hidden, count, config.num_experts_per_tok)
    experts = ClampedSwiGLUExperts(hidden, width, count, config.expert_swiglu_alpha, config.expert_swiglu_limit)
    mlp = MoE(hidden, width, count, config.num_experts_per_tok, False, router=router, experts=experts)
    return DecoderLayer(hidden, config.rms_norm_eps, attention, mlp)


GPT_OSS = Family("gpt_oss", read_options, build_layer, "GptOssForCausalLM", write_options, hf_renames=HF_RENAMES,
                 hf_fused_experts=False)
