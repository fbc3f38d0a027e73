"""Where export reads a model's tensors from, by name: a training checkpoint's step directory
(DCP reshards whatever layout it was saved under, and only model tensors are read), or a
Hugging Face directory (the base of a LoRA checkpoint trained straight from one)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from llmflow.models.config import ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.weights.dcp import dcp_load
from llmflow.weights.errors import CheckpointError
from llmflow.weights.hf import StoredParts, read_parameter, stored_parameters
from llmflow.weights.hf_names import checkpoint_tensors
from llmflow.weights.training_checkpoint import (
    META,
    MODEL_KEY,
    TOKENIZER_DIR,
    CheckpointMeta,
    lora_base,
    read_meta,
    resolve_step_dir,
    stored_tensors,
)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Global shape and dtype of a stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Source:
    """What an export reads weights from: a checkpoint step directory, or (as the base of a
    LoRA checkpoint trained straight from one) a Hugging Face model directory."""

    path: Path
    meta: CheckpointMeta
    tensors: dict[str, TensorInfo]
    """Model tensors by name (``model.layers.0.self_attn.q_proj.weight``)."""
    hf_files: dict[str, StoredParts] | None = None
    """Where each tensor lies, for a Hugging Face directory; None for a checkpoint."""

    @classmethod
    def checkpoint(cls, step_dir: Path) -> Source:
        stored = stored_tensors(step_dir)
        tensors = {n: TensorInfo(tuple(md.size), md.properties.dtype) for n, md in stored.items()}
        return cls(step_dir, read_meta(step_dir), tensors)

    @classmethod
    def hf_directory(cls, directory: Path) -> Source:
        config = ModelConfig.from_file(directory)
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in checkpoint_tensors(CausalLM(config)).items()}
        files = stored_parameters(directory, config, shapes)
        tensors = {n: TensorInfo(shapes[n], parts[0][1].dtype) for n, parts in files.items()}
        meta = CheckpointMeta(hf_config=config.hf_config, padded_vocab_size=config.vocab_size)
        return cls(directory, meta, tensors, files)

    @property
    def tokenizer_dir(self) -> Path:
        return self.path if self.hf_files is not None else self.path.parent / TOKENIZER_DIR

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full (unsharded) tensors ``names``; DCP reshards them from however they were saved."""
        if self.hf_files is not None:
            return {n: read_parameter(n, self.hf_files[n]) for n in names}
        state = {n: torch.empty(self.tensors[n].shape, dtype=self.tensors[n].dtype) for n in names}
        dcp_load({MODEL_KEY: state}, self.path, collective=False)
        return state


def weight_names(source: Source) -> list[str]:
    """The HF tensors of the model (a tied output projection appears once, as the
    embedding), checked against what the source stores."""
    config = ModelConfig.from_hf(source.meta.hf_config, source=str(source.path))
    with torch.device("meta"):
        model = CausalLM(config.padded_to(source.meta.padded_vocab_size))
    tensors = checkpoint_tensors(model)
    names = list(tensors)
    missing = [n for n in names if n not in source.tensors]
    if missing:
        raise CheckpointError(f"{source.path}: lacks {len(missing)} model tensors, e.g. {missing[:5]}")
    for name in names:
        stored, expected = source.tensors[name].shape, tuple(tensors[name].shape)
        if stored != expected:
            raise CheckpointError(f"{source.path}: tensor {name!r} has shape {stored}, its config implies {expected}")
    return names


def base_source(lora: Source) -> Source:
    """The frozen base weights of a LoRA checkpoint: a checkpoint, or the Hugging Face
    directory it was trained from."""
    if not lora.meta.base_checkpoint:
        raise CheckpointError(f"{lora.path / META}: LoRA checkpoint names no base_checkpoint to merge into")
    path = lora_base(lora.path, lora.meta)
    base = Source.hf_directory(path) if (path / "config.json").is_file() else Source.checkpoint(resolve_step_dir(path))
    if base.meta.padded_vocab_size != lora.meta.padded_vocab_size:
        raise CheckpointError(
            f"{base.path}: base vocabulary of {base.meta.padded_vocab_size} rows differs from the LoRA "
            f"checkpoint's padded_vocab_size {lora.meta.padded_vocab_size} ({lora.path})"
        )
    return base
