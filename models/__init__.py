"""The decoder and its model families, their configuration and LoRA: pure PyTorch modules
(their weights are read and written by ``llmflow.weights``)."""

# Registers every model family, so ModelConfig and CausalLM know them whichever module is imported first.
from llmflow.models import families  # noqa: F401
from llmflow.models.config import ConfigError, ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.models.lora import (
    LoraConfig,
    LoraLinear,
    apply_lora,
    init_lora_weights,
    is_lora_param,
    lora_state_dict,
    merge_lora,
)

__all__ = [
    "CausalLM",
    "ConfigError",
    "LoraConfig",
    "LoraLinear",
    "ModelConfig",
    "apply_lora",
    "init_lora_weights",
    "is_lora_param",
    "lora_state_dict",
    "merge_lora",
]
