"""The Llama/Qwen2-family decoder, its configuration and Hugging Face checkpoint I/O."""

from llmflow.models.config import ConfigError, ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.models.hf_checkpoint import CheckpointError, load_hf_model, save_hf_model

__all__ = ["CausalLM", "CheckpointError", "ConfigError", "ModelConfig", "load_hf_model", "save_hf_model"]
