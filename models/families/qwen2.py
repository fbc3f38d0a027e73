"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5): Llama's layers with a bias on q/k/v (never on o), and a
sliding window where ``use_sliding_window`` and ``layer_types`` (or ``max_window_layers``)
put one, read as transformers reads them (Qwen3 reads its window the same way)."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import ConfigError, Family, ModelConfig
from llmflow.models.families import llama

# Qwen2Config's and Qwen3Config's defaults for keys a config.json may leave out.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28
LAYER_TYPES = ("full_attention", "sliding_attention")


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, "sliding_window": read_sliding_window(hf, source)}


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
    return {}  # the bias is implied by the family; the sliding-window keys are the original's


QWEN2 = Family("qwen2", read_options, llama.build_layer, "Qwen2ForCausalLM", write_options)
