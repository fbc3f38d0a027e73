"""A whole model from whatever a user points at: a Hugging Face directory, a checkpoint root
or step directory (vocabulary padding included), or a LoRA checkpoint (its base loaded,
the adapters merged in). Training starts from it; generation and evaluation run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmflow.models import CausalLM, LoraConfig, ModelConfig, apply_lora, lora_state_dict, merge_lora
from llmflow.runtime import available_device
from llmflow.weights.hf import load_hf_model
from llmflow.weights.training_checkpoint import (
    is_checkpoint,
    load_model_weights,
    lora_base,
    read_meta,
    resolve_step_dir,
)


def load_model(path: str | Path, device: torch.device | str = "cpu", merge: bool = True) -> tuple[CausalLM, dict[str, Any]]:
    """The model in ``path`` (fp32) and its HF config dict (with the original vocab_size).

    A LoRA checkpoint gives its base with the adapters applied, merged into the base
    weights when ``merge`` (else left as adapters)."""
    path = Path(path)
    device = available_device(device)
    if is_checkpoint(path):
        return _load_checkpoint_model(resolve_step_dir(path), device, merge)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {path}: neither a Hugging Face model directory (config.json) nor a checkpoint (latest)")
    return load_hf_model(path, device=device), json.loads((path / "config.json").read_text())


def _load_checkpoint_model(step_dir: Path, device: torch.device, merge: bool) -> tuple[CausalLM, dict[str, Any]]:
    meta = read_meta(step_dir)
    if meta.lora is not None:
        model, hf_config = load_model(lora_base(step_dir, meta), device)
        apply_lora(model, LoraConfig(**meta.lora))
        load_model_weights(step_dir, lora_state_dict(model))
        if merge:
            merge_lora(model)
        return model, hf_config
    config = ModelConfig.from_hf(meta.hf_config).padded_to(meta.padded_vocab_size)
    # Built on the meta device: every weight is read from the checkpoint, so initialising
    # them first would only cost time (most of the load at 0.5B parameters).
    with torch.device("meta"):
        model = CausalLM(config)
    model.to_empty(device=device)
    tied = config.tie_word_embeddings
    if tied:  # to_empty gives each module a tensor of its own
        model.lm_head.weight = model.model.embed_tokens.weight
    load_model_weights(step_dir, {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")})
    model.model.reset_rope(device)
    return model, meta.hf_config


def hf_config_of(path: str | Path) -> dict[str, Any]:
    """The HF config of the model in ``path`` (HF directory or checkpoint), without reading its weights."""
    path = Path(path)
    if is_checkpoint(path):
        return read_meta(resolve_step_dir(path)).hf_config
    return json.loads((path / "config.json").read_text())
