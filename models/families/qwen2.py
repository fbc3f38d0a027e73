"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5): Llama's layers with a bias on q/k/v (never on o), and a
sliding window only when config.json's ``use_sliding_window`` turns it on."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import ConfigError, Family, ModelConfig
from llmflow.models.families import llama


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    sliding_window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if sliding_window is not None and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]:
        raise ConfigError(f"{source}: Qwen2 sliding window on only some layers is not supported")
    return {"qkv_bias": True, "o_bias": False, "sliding_window": sliding_window}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {}  # the bias is implied by the family; the sliding-window keys are the original's


QWEN2 = Family("qwen2", read_options, llama.build_layer, "Qwen2ForCausalLM", write_options)
