"""Mistral: Llama's layers, attending within config.json's ``sliding_window`` (v0.1; null
in later versions, which attend to the whole prefix)."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import Family, ModelConfig
from llmflow.models.families import llama


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**llama.read_options(hf, source), "sliding_window": hf.get("sliding_window")}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {**llama.write_options(config), "sliding_window": config.sliding_window}


MISTRAL = Family("mistral", read_options, llama.build_layer, "MistralForCausalLM", write_options)
