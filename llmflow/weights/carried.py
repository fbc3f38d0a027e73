"""Carried tensors: the tensors of a Hugging Face checkpoint that the decoder does not hold (a
vision tower, multi-token prediction layers), kept bit for bit from convert through training
to export, so that the exported model is the whole model the user brought.

Which tensors are carried is the family's word: those loading leaves out
(``hf_names.left_out_prefix``), the names under its ``hf_left_out`` prefixes (Qwen3.5's
``model.visual.`` and ``mtp.``, Qwen3-Next's ``mtp.``) and any other part the family declares
no part of the decoder. Any other tensor with no place in the decoder is still refused
(``hf.stored_parameters``), so a misspelt name, or a vision tower in a text-only family's
checkpoint, is caught. Two kinds of tensor are neither loaded nor carried, as transformers
does not save them: rotary ``inv_freq`` buffers, and a tied output projection stored beside
the embedding.

Where they are:

- convert writes them into ``CKPT/carried/``, in the Hugging Face weights layout
  (``model.safetensors``, or shards and ``model.safetensors.index.json``), and the step's
  ``meta.json`` counts them by prefix (``CheckpointMeta.carried``);
- a training run gives its own root the same ``carried/`` before its first step
  (``carry_untrained``: from the checkpoint it starts from, or straight from the Hugging Face
  directory), and its checkpoints count them as the one it started from did; a LoRA run
  keeps only adapters, and its carried tensors are its base's;
- export writes them back beside the trained tensors, under their names, in their dtypes,
  byte for byte (``--dtype`` casts the trained tensors only).

Each is read and written alone, with plain file reads, like every other tensor llmflow moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from llmflow.artifacts import atomic_directory
from llmflow.models.config import ModelConfig
from llmflow.weights.errors import CheckpointError
from llmflow.weights.finite import check_finite
from llmflow.weights.hf import index_hf_tensors, write_hf_weights
from llmflow.weights.hf_names import left_out_prefix
from llmflow.weights.safetensors_io import StoredTensor, TensorSpecs, read_tensor
from llmflow.weights.training_checkpoint import (
    META,
    checkpoint_root,
    is_checkpoint,
    lora_base,
    read_meta,
    resolve_step_dir,
)

CARRIED_DIR = "carried"
"""The folder of a checkpoint root that holds its carried tensors."""
MAX_SHARD_BYTES = 4 * 2**30


@dataclasses.dataclass(frozen=True)
class Carried:
    """The carried tensors of one model, where they lie."""

    tensors: dict[str, StoredTensor] = dataclasses.field(default_factory=dict)
    """By their name in the original checkpoint (``model.visual.blocks.0.attn.qkv.weight``)."""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """How many there are under each prefix, in name order (``{"model.visual.": 12, "mtp.": 3}``)."""

    def line(self) -> str:
        """``carried, not trained: model.visual.* (12 tensors), mtp.* (3 tensors)``."""
        return carried_line(self.counts)

    def specs(self) -> TensorSpecs:
        return {name: (stored.dtype, stored.shape) for name, stored in self.tensors.items()}

    def read(self, names: list[str]) -> Iterator[torch.Tensor]:
        """The tensors ``names``, one at a time, as stored, each checked for NaN/Inf."""
        for name in names:
            tensor = read_tensor(self.tensors[name])
            check_finite(tensor, self.tensors[name].path, name)
            yield tensor


def carried_line(counts: dict[str, int]) -> str:
    return f"carried, not trained: {_described(counts)}"


def _described(counts: dict[str, int]) -> str:
    return ", ".join(f"{prefix}* ({n} tensor{'s' if n != 1 else ''})" for prefix, n in counts.items())


def carried_tensors(hf_tensors: dict[str, StoredTensor], config: ModelConfig) -> Carried:
    """The tensors of a checkpoint (by name, ``hf.index_hf_tensors``) that the decoder of
    ``config`` leaves out, counted by prefix in name order."""
    tensors, counts = {}, {}
    for name, stored in hf_tensors.items():
        prefix = left_out_prefix(name, config)
        if prefix is not None:
            tensors[name] = stored
            counts[prefix] = counts.get(prefix, 0) + 1
    return Carried(tensors, dict(sorted(counts.items())))


def write_carried(directory: Path, carried: Carried) -> None:
    """The carried tensors as a Hugging Face weights folder ``directory``, tensor by tensor."""
    directory.mkdir(parents=True, exist_ok=True)
    write_hf_weights(directory, carried.specs(), MAX_SHARD_BYTES, carried.read)


def untrained_tensors(path: Path) -> Carried:
    """The carried tensors of the model in ``path``: the tensors of a Hugging Face directory
    that its decoder leaves out, a checkpoint's ``carried/`` (a LoRA checkpoint's base's), checked
    against what its meta.json counts; none for a checkpoint that counts none."""
    if not is_checkpoint(path):
        return carried_tensors(index_hf_tensors(path), ModelConfig.from_file(path))
    step_dir = resolve_step_dir(path)
    meta = read_meta(step_dir)
    if meta.lora is not None:
        return untrained_tensors(lora_base(step_dir, meta))
    if not meta.carried:
        return Carried()
    directory = checkpoint_root(step_dir) / CARRIED_DIR
    if not directory.is_dir():
        raise CheckpointError(f"{step_dir / META} counts carried tensors ({_described(meta.carried)}), "
                              f"but {directory} is missing")
    stored = index_hf_tensors(directory)
    carried = carried_tensors(stored, ModelConfig.from_hf(meta.hf_config, source=str(step_dir / META)))
    if carried.counts != meta.carried or len(carried.tensors) != len(stored):
        raise CheckpointError(f"{directory} holds {len(stored)} tensors ({_described(carried.counts)} carried) where "
                              f"{step_dir / META} counts {_described(meta.carried)}; the folder is damaged")
    return carried


def carry_untrained(carried: Carried, root: Path) -> None:
    """Give the training run's checkpoint root ``root`` the carried tensors of the model it
    starts from (unless it has them: a resumed run), written beside and renamed into place."""
    if carried.tensors and not (root / CARRIED_DIR).is_dir():
        with atomic_directory(root / CARRIED_DIR) as work:
            write_carried(work, carried)
