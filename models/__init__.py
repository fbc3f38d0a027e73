"""The decoder and its model families, their configuration, Hugging Face checkpoint I/O and LoRA."""

# Registers every model family, so ModelConfig and CausalLM know them whichever module is imported first.
from llmflow.models import families  # noqa: F401
from llmflow.models.config import ConfigError, ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.models.hf_checkpoint import CheckpointError, load_hf_model, save_hf_model
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
    "CheckpointError",
    "ConfigError",
    "LoraConfig",
    "LoraLinear",
    "ModelConfig",
    "apply_lora",
    "init_lora_weights",
    "is_lora_param",
    "load_hf_model",
    "lora_state_dict",
    "merge_lora",
    "save_hf_model",
]
