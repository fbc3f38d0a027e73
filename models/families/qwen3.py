"""Qwen3 (dense): Llama's layers with an RMSNorm over each head's queries and keys before
rotary (``self_attn.q_norm``, ``self_attn.k_norm``), config.json's ``head_dim`` (128 when it
has none, as transformers' ``Qwen3Config``), biases on q/k/v and o only when
``attention_bias`` asks for them, and a sliding window where ``use_sliding_window`` and
``layer_types`` (or ``max_window_layers``) put one."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.qwen2 import read_sliding_window

DEFAULT_HEAD_DIM = 128
"""Qwen3Config's head_dim where config.json has none."""


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    # Qwen3's MLP never has biases, whatever mlp_bias says.
    return {"head_dim": hf.get("head_dim") or DEFAULT_HEAD_DIM, "qkv_bias": bias, "o_bias": bias, "mlp_bias": False,
            "qk_norm": True, "sliding_window": read_sliding_window(hf, source)}


def write_options(config: ModelConfig) -> dict[str, Any]:
    # head_dim is written for every family; the sliding-window keys are the original's.
    return {"attention_bias": config.qkv_bias}


QWEN3 = Family("qwen3", read_options, llama.build_layer, "Qwen3ForCausalLM", write_options)
