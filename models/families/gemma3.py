"""Gemma 3's text decoder (``gemma3_text``, transformers' ``Gemma3ForCausalLM``: Gemma 3 1B as
published; the Hub's 4B-27B checkpoints are multimodal, model_type ``gemma3``, which llmflow
does not read): layers of local attention within ``sliding_window`` and global attention
(``layer_types``, else every ``sliding_window_pattern``-th layer global), with

- the embedding scaled by sqrt(hidden_size) (in the embedding's dtype) and tied to the output
  projection by default, its ``pad_token_id`` row without gradient from the lookup;
- zero-centred RMSNorms (applied as 1 + w) before and after attention and the MLP
  (``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``), on each head's queries and keys, and at the end;
- attention scores scaled by ``query_pre_attn_scalar`` ** -0.5;
- rotary of base ``rope_local_base_freq`` (unscaled) on the local layers, ``rope_theta`` and
  ``rope_scaling`` on the global ones (transformers 5 writes both as ``rope_parameters`` per
  layer type);
- a GeGLU MLP (``hidden_activation`` gelu_pytorch_tanh) and the final-logit soft cap
  ``final_logit_softcapping`` (None in the published Gemma 3 configs).

Refused: ``attn_logit_softcapping`` (Gemma 2's attention soft cap; None in Gemma 3),
``use_bidirectional_attention`` and any other activation.
"""

from __future__ import annotations

from typing import Any

from llmflow.models.blocks.attention import Attention
from llmflow.models.blocks.decoder_layer import SandwichDecoderLayer
from llmflow.models.blocks.mlp import MLP
from llmflow.models.config import ConfigError, Family, ModelConfig

# Gemma3TextConfig's defaults for keys a config.json may leave out.
DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True, "pad_token_id": 0,
            "bos_token_id": 2, "eos_token_id": 1, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
ACTIVATION = "gelu_pytorch_tanh"
LAYER_TYPES = ("sliding_attention", "full_attention")


def read_layer_types(hf: dict[str, Any], source: str) -> tuple[str, ...]:
    """``layer_types``, else every ``sliding_window_pattern``-th layer global, as transformers."""
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", DEFAULTS["sliding_window_pattern"])
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"{source}: layer_types {unknown} are not supported; expected {LAYER_TYPES}")
    if len(types) != layers:
        raise ConfigError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    return tuple(types)


def read_rotary(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The global layers' rotary base and the local layers' (their rotary never scaled), from
    ``rope_parameters`` per layer type or transformers 4's ``rope_theta`` and
    ``rope_local_base_freq``, with Gemma3TextConfig's defaults. The global layers' scaling is
    the shared reading's (``ModelConfig.from_hf``), which takes a per-layer-type
    ``rope_parameters``' 'full_attention' entry."""
    params = hf.get("rope_parameters")
    if params is None:
        full, local = hf, {"rope_theta": hf.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"])}
    elif not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
        raise ConfigError(f"{source}: rope_parameters={params!r}; Gemma 3 holds one per layer type {LAYER_TYPES}")
    else:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"{source}: rope_parameters.sliding_attention.rope_type={local['rope_type']!r}; llmflow "
                          "rotates the sliding-window layers unscaled ('default')")
    return {"rope_theta": float(full.get("rope_theta", hf.get("rope_theta", DEFAULTS["rope_theta"]))),
            "sliding_rope_theta": float(local.get("rope_theta", DEFAULTS["rope_local_base_freq"]))}


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    activation = hf.get("hidden_activation", ACTIVATION)
    if activation != ACTIVATION:
        raise ConfigError(f"{source}: hidden_activation={activation!r}; Gemma 3's MLP uses {ACTIVATION!r}")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            raise ConfigError(f"{source}: {key}={hf[key]!r} is not supported (Gemma 3 sets none)")
    types = read_layer_types(hf, source)
    window = hf.get("sliding_window", DEFAULTS["sliding_window"])
    if window is None and "sliding_attention" in types:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")
    bias = bool(hf.get("attention_bias", False))
    defaults = {key: hf.get(key, DEFAULTS[key]) for key in ("max_position_embeddings", "bos_token_id", "eos_token_id")}
    return {
        **defaults, **read_rotary(hf, source),
        "head_dim": hf.get("head_dim") or DEFAULTS["head_dim"],
        "num_key_value_heads": hf.get("num_key_value_heads") or DEFAULTS["num_key_value_heads"],
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])),
        "qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True, "zero_centered_norms": True,
        "sandwich_norms": True, "hidden_act": ACTIVATION, "layer_types": types, "sliding_window": window,
        "attention_scale": float(hf.get("query_pre_attn_scalar", DEFAULTS["query_pre_attn_scalar"])) ** -0.5,
        "embedding_scale": hf["hidden_size"] ** 0.5,
        "embedding_padding_idx": hf.get("pad_token_id", DEFAULTS["pad_token_id"]),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }


def write_options(config: ModelConfig) -> dict[str, Any]:
    # The rest (window, layer types, scalar, soft cap, local rotary base) are the original's.
    return {"attention_bias": config.qkv_bias, "hidden_activation": config.hidden_act}


def build_layer(config: ModelConfig, index: int) -> SandwichDecoderLayer:
    attention = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                          qkv_bias=config.qkv_bias, o_bias=config.o_bias, sliding_window=config.layer_window(index),
                          qk_norm_eps=config.rms_norm_eps, zero_centered_norm=True, scale=config.attention_scale)
    mlp = MLP(config.hidden_size, config.intermediate_size, bias=False, activation=config.hidden_act)
    return SandwichDecoderLayer(config.hidden_size, config.rms_norm_eps, attention, mlp, zero_centered_norm=True)


GEMMA3_TEXT = Family("gemma3_text", read_options, build_layer, "Gemma3ForCausalLM", write_options)
