"""Qwen3 (dense): Llama's layers with an RMSNorm over each head's queries and keys before
rotary (``self_attn.q_norm``, ``self_attn.k_norm``), config.json's ``head_dim`` (128 when it
has none, as transformers' ``Qwen3Config``), biases on q/k/v and o only when
``attention_bias`` asks for them, and a sliding window where ``use_sliding_window`` and
``layer_types`` (or ``max_window_layers``) put one."""

from __future__ import annotations

from typing import Any

from llmflow.models.blocks.attention import Attention
from llmflow.models.blocks.decoder_layer import DecoderLayer
from llmflow.models.blocks.mlp import MLP
from llmflow.models.config import ConfigError, Family, ModelConfig

# Qwen3Config's defaults for keys a config.json may leave out.
DEFAULT_HEAD_DIM = 128
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28
LAYER_TYPES = ("full_attention", "sliding_attention")


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    # Qwen3's MLP never has biases, whatever mlp_bias says.
    return {"head_dim": hf.get("head_dim") or DEFAULT_HEAD_DIM, "qkv_bias": bias, "o_bias": bias, "mlp_bias": False,
            "qk_norm": True, "sliding_window": read_sliding_window(hf, source)}


def read_sliding_window(hf: dict[str, Any], source: str) -> int | None:
    """The window every layer attends within (None: the whole prefix), as transformers reads
    it: ``sliding_window`` when ``use_sliding_window``, on the layers ``layer_types`` calls
    ``sliding_attention`` (by default those from ``max_window_layers`` on)."""
    window = hf.get("sliding_window", DEFAULT_SLIDING_WINDOW) if hf.get("use_sliding_window", False) else None
    layers = hf["num_hidden_layers"]
    first_sliding = hf.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention" for i in range(layers)
    ]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"{source}: layer_types {unknown} are not supported; expected {LAYER_TYPES}")
    if len(types) != layers:
        raise ConfigError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    sliding = sum(t == "sliding_attention" for t in types)
    if sliding and window is None:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but use_sliding_window/sliding_window "
                          "set no window")
    if 0 < sliding < layers:
        raise ConfigError(f"{source}: a sliding window on {sliding} of {layers} layers (layer_types/max_window_layers) "
                          "is not supported; llmflow attends within one window on every layer or none")
    return window if sliding else None


def write_options(config: ModelConfig) -> dict[str, Any]:
    # head_dim is written for every family; the sliding-window keys are the original's.
    return {"attention_bias": config.qkv_bias}


def build_layer(config: ModelConfig) -> DecoderLayer:
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
    mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
    return DecoderLayer(config.hidden_size, config.rms_norm_eps, attention, mlp)


QWEN3 = Family("qwen3", read_options, build_layer, "Qwen3ForCausalLM", write_options)
