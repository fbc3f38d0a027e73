"""An llmflow checkpoint written as a megatron-core GPTModel checkpoint that Megatron-LM,
MindSpeed-LLM and megatron-core's own ``dist_checkpointing.load`` read.

``torch_dist`` (the default) is written from one process with torch.distributed.checkpoint, the
way megatron-core lays it out: whole tensors with their global shapes, layers stacked on dim 0
and stored one chunk per layer, each chunk computed from the llmflow tensors of its layer only
when the writer comes to it, so memory stays about one layer; the Transformer Engine extra
states megatron-core's loader requires; ``common.pt`` (Megatron-LM's ``args``, the iteration,
the checkpoint version) and ``metadata.json``. megatron-core reshards on load, so the tensor
and pipeline parallel sizes show only in the padded vocabulary (a multiple of
``vocab_multiple`` times ``tp``, as Megatron-LM pads it) and in ``args``.

The legacy layout (``legacy``) is Megatron-LM's ``--ckpt-format torch``: one
``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` per tensor and pipeline rank, with that
rank's shards of its stage's layers under the local layer spec's names, built one rank at a
time. Both end with ``latest_checkpointed_iteration.txt``.
"""

from __future__ import annotations

import io
import json
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from llmflow.models.config import ModelConfig
from llmflow.weights.dcp import dcp_save
from llmflow.weights.errors import CheckpointError
from llmflow.weights.megatron.layout import (
    EMBEDDING,
    EXTRA_STATE_MODULES,
    FINAL_NORM,
    LAYER_SOURCES,
    LAYERS,
    LOCAL_NORM_NAMES,
    OTHER_SOURCES,
    OUTPUT,
    Attention,
    extra_state_key,
    fuse,
    layer_shapes,
    layer_tensors,
    missing_biases,
    other_tensors,
    split_shards,
)
from llmflow.weights.megatron.reader import LEGACY_FILE, TRACKER
from llmflow.weights.training_checkpoint import padded_vocab_size

CHECKPOINT_VERSION = 3.0
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}

Load = Callable[[list[str]], dict[str, torch.Tensor]]
"""Reads llmflow model tensors (``model.layers.0.self_attn.q_proj.weight``) by name."""


class MegatronModel:
    """The Megatron tensors of one llmflow model, computed layer by layer from its tensors, all
    in one dtype (the one the torch_dist plan declares for them)."""

    def __init__(self, config: ModelConfig, load: Load, padded_vocab: int, dtype: torch.dtype) -> None:
        self.config, self.load, self.padded_vocab, self.dtype = config, load, padded_vocab, dtype
        self.attention = Attention.of(config)
        self.layer_shapes = layer_shapes(config)

    def layer(self, name: str, i: int) -> torch.Tensor:
        """One layer's megatron tensor ``name``."""
        names = [f"model.layers.{i}.{part}" for part in LAYER_SOURCES[name]]
        tensors = self.load(names)
        return self._cast(fuse(name, [tensors[n] for n in names], self.attention))

    def other(self, key: str) -> torch.Tensor:
        """The embedding, output layer (vocabulary padded Megatron's way, with zero rows) or final norm."""
        name = OTHER_SOURCES[key]
        tensor = self.load([name])[name]
        if key == FINAL_NORM:
            return self._cast(tensor)
        rows = tensor[: self.config.vocab_size]
        return self._cast(torch.cat([rows, rows.new_zeros(self.padded_vocab - rows.shape[0], rows.shape[1])]))

    def other_shape(self, key: str) -> tuple[int, ...]:
        return (self.config.hidden_size,) if key == FINAL_NORM else (self.padded_vocab, self.config.hidden_size)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype).contiguous()


def megatron_args(config: ModelConfig, tp: int, pp: int, padded_vocab: int, vocab_multiple: int, iteration: int,
                  dtype: torch.dtype) -> Namespace:
    """Megatron-LM's arguments for this model, as its checkpoint loaders read them."""
    a = Attention.of(config)
    scaling = config.rope_scaling or {}
    return Namespace(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size,
        num_attention_heads=a.heads, group_query_attention=a.groups != a.heads, num_query_groups=a.groups,
        kv_channels=a.head_dim, max_position_embeddings=config.max_position_embeddings,
        seq_length=config.max_position_embeddings, position_embedding_type="rope",
        use_rotary_position_embeddings=True, rotary_base=int(config.rope_theta), rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)), normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps, norm_epsilon=config.rms_norm_eps, apply_layernorm_1p=False,
        swiglu=True, add_bias_linear=False, add_qkv_bias=config.qkv_bias, qk_layernorm=config.qk_norm,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings, vocab_size=config.vocab_size,
        padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=vocab_multiple,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1, num_experts=None, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, transformer_impl="local", iteration=iteration, consumed_train_samples=0,
        consumed_valid_samples=0, no_save_optim=True, no_save_rng=True,
    )


class LayerChunkSavePlanner(DefaultSavePlanner):
    """Plans megatron-core's chunks (one per layer of a stacked tensor, one per other tensor,
    and the extra-state objects) and computes each only when the writer asks for it."""

    def __init__(self, model: MegatronModel) -> None:
        super().__init__()
        self.model = model

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        layers = self.model.config.num_hidden_layers
        items = []
        for key in other_tensors(self.model.config):
            items.append(self._item(key, self.model.other_shape(key), None))
        for name in layer_tensors(self.model.config):
            items += [self._item(LAYERS + name, (layers, *self.model.layer_shapes[name]), i) for i in range(layers)]
        for module in EXTRA_STATE_MODULES:
            items += [WriteItem(MetadataIndex(extra_state_key(module, i, layers)), WriteItemType.BYTE_IO)
                      for i in range(layers)]
        # planner_data maps each key to its path in the (flat) state dict, as flattening would.
        self.plan = SavePlan(items, planner_data={item.index.fqn: (item.index.fqn,) for item in items})
        return self.plan

    def _item(self, key: str, shape: tuple[int, ...], layer: int | None) -> WriteItem:
        offsets = torch.Size((0,) * len(shape)) if layer is None else torch.Size((layer,) + (0,) * (len(shape) - 1))
        sizes = torch.Size(shape) if layer is None else torch.Size((1, *shape[1:]))
        data = TensorWriteData(ChunkStorageMetadata(offsets, sizes), TensorProperties(dtype=self.model.dtype),
                               torch.Size(shape))
        return WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD, tensor_data=data)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return self.transform_object(write_item, [None])  # Transformer Engine's empty extra state
        if key.startswith(LAYERS):
            return self.model.layer(key.removeprefix(LAYERS), write_item.index.offset[0]).unsqueeze(0)
        return self.model.other(key)


def write_torch_dist(directory: Path, model: MegatronModel, args: Namespace, iteration: int) -> None:
    """megatron-core's torch_dist checkpoint of ``model`` in ``directory``."""
    writer = FileSystemWriter(str(directory), single_file_per_rank=False)
    dcp_save({}, directory, writer=writer, planner=LayerChunkSavePlanner(model))
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0, "content_metadata": CONTENT_METADATA}
    torch.save(common, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(BACKEND))


def rank_state(model: MegatronModel, tp: int, pp: int, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor | None]:
    """The model state of one legacy rank file: its shards of its stage's layers (numbered from
    0 in the stage) under the local layer spec's names, and of the embedding (first stage) or
    final norm and output layer (last stage)."""
    layers = model.config.num_hidden_layers // pp
    local_names = {common: own for own, common in LOCAL_NORM_NAMES.items()}
    state: dict[str, torch.Tensor | None] = {}
    if pp_rank == 0:
        state[EMBEDDING] = split_shards(EMBEDDING, model.other(EMBEDDING), tp)[tp_rank].clone()
    for local in range(layers):
        for name in layer_tensors(model.config):
            tensor = model.layer(name, pp_rank * layers + local)
            state[f"{LAYERS}{local}.{local_names.get(name, name)}"] = split_shards(name, tensor, tp)[tp_rank].clone()
        for module in EXTRA_STATE_MODULES:
            state[f"{LAYERS}{local}.{module}._extra_state"] = None
    if pp_rank == pp - 1:
        state[FINAL_NORM] = model.other(FINAL_NORM)
        if not model.config.tie_word_embeddings or pp > 1:  # a shared embedding's copy on the last stage
            source = EMBEDDING if model.config.tie_word_embeddings else OUTPUT
            state[OUTPUT] = split_shards(OUTPUT, model.other(source), tp)[tp_rank].clone()
        state["output_layer._extra_state"] = None
    return state


def write_legacy(directory: Path, model: MegatronModel, args: Namespace, iteration: int, tp: int, pp: int) -> None:
    """Megatron-LM's legacy per-rank checkpoint of ``model`` in ``directory``, one rank at a time."""
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank_dir = directory / (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else ""))
            rank_dir.mkdir(parents=True)
            state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                     "model": rank_state(model, tp, pp, tp_rank, pp_rank), "num_floating_point_operations_so_far": 0}
            torch.save(state, rank_dir / LEGACY_FILE)


def write_megatron(work: Path, config: ModelConfig, load: Load, tp: int, pp: int, iteration: int,
                   vocab_multiple: int, dtype: torch.dtype, legacy: bool) -> int:
    """The checkpoint root in ``work``: ``iter_{iteration:07d}`` in the chosen format and its
    tracker file, every tensor in ``dtype``. Returns the padded vocabulary."""
    if biases := missing_biases(config):
        raise CheckpointError(f"--megatron: the model has {biases}, which Megatron's layout (q/k/v biases only) "
                              "cannot hold")
    if config.num_hidden_layers % pp:
        raise CheckpointError(f"--pp {pp}: the model's {config.num_hidden_layers} layers do not split evenly into "
                              f"{pp} pipeline stages (Megatron-LM's default split)")
    for name, count in (("attention heads", config.num_attention_heads), ("query groups", config.num_key_value_heads),
                        ("feed-forward width", config.intermediate_size)):
        if count % tp:
            raise CheckpointError(f"--tp {tp}: the model's {count} {name} do not divide among {tp} ranks")
    padded = padded_vocab_size(config.vocab_size, vocab_multiple * tp)  # Megatron-LM's _vocab_size_with_padding
    model = MegatronModel(config, load, padded, dtype)
    args = megatron_args(config, tp, pp, padded, vocab_multiple, iteration, dtype)
    directory = work / f"iter_{iteration:07d}"
    if legacy:
        write_legacy(directory, model, args, iteration, tp, pp)
    else:
        directory.mkdir(parents=True)
        write_torch_dist(directory, model, args, iteration)
    (work / TRACKER).write_text(str(iteration))
    return padded
