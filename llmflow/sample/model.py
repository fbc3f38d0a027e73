"""The sample's tiny model: a Qwen2-style decoder with seeded random weights, saved as Hugging
Face safetensors with config.json and generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch

from llmflow.models import CausalLM, ModelConfig
from llmflow.sample.tokenizer import ENDOFTEXT, IM_END, MAX_POSITIONS
from llmflow.weights import save_hf_model


def model_hf_config(tokenizer: tokenizers.Tokenizer) -> dict[str, Any]:
    """config.json of the tiny model: Qwen2 with GQA and tied embeddings, its vocabulary the
    tokenizer's rounded up to a multiple of 64."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": -(-tokenizer.get_vocab_size() // 64) * 64,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": 4,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
    }


def write_model(tokenizer: tokenizers.Tokenizer, directory: Path, seed: int) -> Path:
    """The tiny model with seeded random weights, its generation config and tokenizer files."""
    model = CausalLM(ModelConfig.from_hf(model_hf_config(tokenizer)))
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    save_hf_model(model, directory)
    generation = {
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)],
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory
