"""A whole model from whatever a user points at: a Hugging Face directory, a checkpoint root
or step directory (vocabulary padding included), or a LoRA checkpoint (its base loaded,
the adapters merged in). Training starts from it; generation and evaluation run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmflow.checkpoint import (
    LATEST,
    META,
    MODEL_KEY,
    TOKENIZER_DIR,
    CheckpointError,
    load_checkpoint,
    read_meta,
    resolve_step_dir,
)
from llmflow.data.tokenizer import has_tokenizer
from llmflow.models import CausalLM, LoraConfig, ModelConfig, apply_lora, load_hf_model, lora_state_dict, merge_lora
from llmflow.models.hf_checkpoint import check_finite
from llmflow.runtime import available_device


def is_checkpoint(path: Path) -> bool:
    return (path / LATEST).is_file() or (path / META).is_file()


def _checkpoint_root(step_dir: Path) -> Path:
    return step_dir if (step_dir / LATEST).is_file() else step_dir.parent


def load_model(path: str | Path, device: torch.device | str = "cpu", merge: bool = True) -> tuple[CausalLM, dict[str, Any]]:
    """The model in ``path`` (fp32) and its HF config dict (with the original vocab_size).

    A LoRA checkpoint gives its base with the adapters applied, merged into the base
    weights when ``merge`` (else left as adapters)."""
    path = Path(path)
    device = available_device(device)
    if not is_checkpoint(path):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model {path}: neither a Hugging Face model directory (config.json) nor a checkpoint (latest)")
        return load_hf_model(path, device=device), json.loads((path / "config.json").read_text())
    step_dir = resolve_step_dir(path)
    meta = read_meta(step_dir)
    if meta.lora is not None:
        if meta.base_checkpoint is None:
            raise CheckpointError(f"{step_dir}: a LoRA checkpoint without base_checkpoint")
        base = Path(meta.base_checkpoint)
        base = base if base.is_absolute() else _checkpoint_root(step_dir) / base
        model, hf_config = load_model(base, device)
        apply_lora(model, LoraConfig(**meta.lora))
        adapters = lora_state_dict(model)
        load_checkpoint(step_dir, {"model": adapters})
        _check_finite(step_dir, adapters)
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
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    load_checkpoint(step_dir, {"model": state})
    _check_finite(step_dir, state)
    model.model.reset_rope(device)
    return model, meta.hf_config


def _check_finite(step_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Refuse loaded weights that hold NaN or ±Inf, naming the step directory and the tensor."""
    for name, tensor in state.items():
        check_finite(tensor, step_dir, f"{MODEL_KEY}.{name}")


def hf_config_of(path: str | Path) -> dict[str, Any]:
    """The HF config of the model in ``path`` (HF directory or checkpoint), without reading its weights."""
    path = Path(path)
    if is_checkpoint(path):
        return read_meta(resolve_step_dir(path)).hf_config
    return json.loads((path / "config.json").read_text())


def tokenizer_dir(path: str | Path) -> Path | None:
    """Where the tokenizer of the model in ``path`` is: the HF directory itself, a
    checkpoint's ``tokenizer/`` folder, or (LoRA) its base's."""
    path = Path(path)
    if not is_checkpoint(path):
        return path if has_tokenizer(path) else None
    step_dir = resolve_step_dir(path)
    root = _checkpoint_root(step_dir)
    if has_tokenizer(root / TOKENIZER_DIR):
        return root / TOKENIZER_DIR
    meta = read_meta(step_dir)
    if meta.base_checkpoint is not None:
        base = Path(meta.base_checkpoint)
        return tokenizer_dir(base if base.is_absolute() else root / base)
    return None
