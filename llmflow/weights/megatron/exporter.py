"""An llmflow checkpoint written as a megatron-core GPTModel checkpoint that Megatron-LM,
MindSpeed-LLM and megatron-core's own ``dist_checkpointing.load`` read.

``torch_dist`` (the default) is written from one process with torch.distributed.checkpoint, the
way megatron-core lays it out: whole tensors with their global shapes, layers stacked on dim 0
(each layer under its own keys when dense and MoE layers mix) and stored one chunk per layer,
each chunk computed from the llmflow tensors of its layer only when the writer comes to it, so
memory stays about one layer; the Transformer Engine extra states megatron-core's loader
requires (per layer, and per expert for the routed experts); ``common.pt`` (Megatron-LM's
``args``, the iteration, the checkpoint version) and ``metadata.json``. megatron-core reshards
on load, so the tensor, pipeline and expert parallel sizes show only in the padded vocabulary
(a multiple of ``vocab_multiple`` times ``tp``, as Megatron-LM pads it) and in ``args``.

The legacy layout (``legacy``) is Megatron-LM's ``--ckpt-format torch``: one
``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` per tensor, pipeline and expert
parallel rank, with that rank's shards of its stage's layers and of its expert-parallel rank's
experts (numbered from 0 in each rank), built one rank at a time. Both end with
``latest_checkpointed_iteration.txt``.

Names follow a layer spec (``Spec``): the Transformer Engine spec's (Megatron-LM's default)
or the local spec's. They differ in the post-attention norm of a MoE layer in torch_dist
(``pre_mlp_layernorm.weight`` against ``mlp.linear_fc1.layer_norm_weight``) and in every
norm of a legacy file (the local spec keeps its ``input_layernorm``/``pre_mlp_layernorm``).
"""

from __future__ import annotations

import io
import json
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
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
    EXPERT_MODULES,
    EXPERTS,
    FINAL_NORM,
    FP32,
    LAYERS,
    OTHER_SOURCES,
    OUTPUT,
    Attention,
    Spec,
    extra_state_key,
    extra_state_modules,
    fuse,
    layer_shapes,
    layer_sources,
    layer_tensors,
    legacy_expert_name,
    missing_biases,
    mla_args,
    moe_layer_freq,
    other_tensors,
    router_args,
    split_shards,
    stacked,
    stored_name,
    unmapped_layers,
)
from llmflow.weights.megatron.reader import LEGACY_FILE, TRACKER, rank_dir_name
from llmflow.weights.training_checkpoint import padded_vocab_size

CHECKPOINT_VERSION = 3.0
BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}

Load = Callable[[list[str]], dict[str, torch.Tensor]]
"""Reads llmflow model tensors (``model.layers.0.self_attn.q_proj.weight``) by name."""


class MegatronModel:
    """The Megatron tensors of one llmflow model, computed layer by layer from its tensors, all
    in one dtype (the one the torch_dist plan declares for them) but those megatron-core keeps
    in fp32 (``FP32``)."""

    def __init__(self, config: ModelConfig, load: Load, padded_vocab: int, dtype: torch.dtype) -> None:
        self.config, self.load, self.padded_vocab, self.dtype = config, load, padded_vocab, dtype
        self.attention = Attention.of(config)
        self.layer_shapes = layer_shapes(config)

    def layer(self, name: str, i: int) -> torch.Tensor:
        """One layer's megatron tensor ``name``."""
        names = [f"model.layers.{i}.{part}" for part in layer_sources(self.config, i)[name]]
        tensors = self.load(names)
        return fuse(name, [tensors[n] for n in names], self.attention).to(self.dtype_of(name)).contiguous()

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype of the Megatron tensor ``name``."""
        return torch.float32 if name in FP32 else self.dtype

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


@dataclass(frozen=True)
class Layout:
    """What an export is written for: the parallel sizes Megatron-LM loads it at, the layer
    spec its names follow, and the routed experts' module."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel size: each rank holds num_experts / ep experts (legacy: its own files)."""
    spec: Spec = "transformer_engine"
    grouped: bool = False
    """moe_grouped_gemm: experts in TEGroupedMLP (legacy files: ``mlp.experts.linear_fc1.weight{j}``)
    instead of SequentialMLP (``mlp.experts.local_experts.{j}.linear_fc1.weight``), which
    megatron-core builds by default."""
    legacy: bool = False


def moe_args(config: ModelConfig, layout: Layout) -> dict[str, Any]:
    """Megatron-LM's mixture-of-experts arguments that build and route as llmflow does (the
    router's: ``router_args``)."""
    if not config.num_experts:
        return {"num_experts": None, "expert_model_parallel_size": 1}
    shared = config.shared_expert_intermediate_size
    return {
        "num_experts": config.num_experts,
        "moe_router_topk": config.num_experts_per_tok,
        "moe_ffn_hidden_size": config.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": bool(shared) and config.shared_expert_gated,
        "moe_layer_freq": moe_layer_freq(config),
        "moe_grouped_gemm": layout.grouped,
        "moe_use_legacy_grouped_gemm": False,
        **router_args(config),
        "moe_router_dtype": "fp32",
        "moe_expert_capacity_factor": None,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.tp,
    }


def megatron_args(
    config: ModelConfig, layout: Layout, padded_vocab: int, vocab_multiple: int, iteration: int, dtype: torch.dtype
) -> Namespace:
    """Megatron-LM's arguments for this model, as its checkpoint loaders read them (Multi-head
    Latent Attention's: ``mla_args``; its latent norms are megatron-core's ``qk_layernorm``)."""
    a = Attention.of(config)
    scaling = config.rope_scaling or {}
    latent = bool(config.kv_lora_rank)
    return Namespace(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=a.heads,
        group_query_attention=a.groups != a.heads,
        num_query_groups=a.groups,
        kv_channels=config.v_head_dim if latent else a.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        seq_length=config.max_position_embeddings,
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=int(config.rope_theta) if config.rope_theta.is_integer() else config.rope_theta,
        rotary_percent=config.partial_rotary_factor,
        rotary_interleaved=False,
        use_rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)),
        **mla_args(config),
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        norm_epsilon=config.rms_norm_eps,
        apply_layernorm_1p=False,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=config.qkv_bias and not latent,
        qk_layernorm=config.qk_norm or latent,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        vocab_size=config.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=vocab_multiple,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=None,
        **moe_args(config, layout),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        transformer_impl=layout.spec,
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        no_save_optim=True,
        no_save_rng=True,
    )


class LayerChunkSavePlanner(DefaultSavePlanner):
    """Plans megatron-core's chunks (one per layer of a stacked tensor, one per tensor of a
    layer stored on its own, one per other tensor, and the extra-state objects) and computes
    each only when the writer asks for it."""

    def __init__(self, model: MegatronModel, spec: Spec) -> None:
        super().__init__()
        self.model, self.spec = model, spec
        self.layer_keys: dict[str, tuple[str, int | None]] = {}
        """Each stored layer key: the canonical tensor name, and its layer (None: stacked, the
        layer is the chunk's offset on dim 0)."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        config = self.model.config
        layers, stack, shapes = config.num_hidden_layers, stacked(config), self.model.layer_shapes
        items = []
        for key in other_tensors(config):
            items.append(self._item(key, self.model.other_shape(key), None))
        if stack:
            for name in layer_tensors(config, 0):
                key = LAYERS + stored_name(name, config, 0, self.spec, legacy=False)
                self.layer_keys[key] = (name, None)
                items += [self._item(key, (layers, *shapes[name]), i) for i in range(layers)]
        else:
            for i in range(layers):
                for name in layer_tensors(config, i):
                    key = f"{LAYERS}{i}.{stored_name(name, config, i, self.spec, legacy=False)}"
                    self.layer_keys[key] = (name, i)
                    items.append(self._item(key, shapes[name], None))
        for i in range(layers):
            keys = [extra_state_key(module, i, layers, stack=stack) for module in extra_state_modules(config, i)]
            if config.is_moe_layer(i):
                keys += [
                    extra_state_key(module, i, layers, e, config.num_experts, stack=stack)
                    for module in EXPERT_MODULES
                    for e in range(config.num_experts)
                ]
            items += [WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO) for key in keys]
        # planner_data maps each key to its path in the (flat) state dict, as flattening would.
        self.plan = SavePlan(items, planner_data={item.index.fqn: (item.index.fqn,) for item in items})
        return self.plan

    def _item(self, key: str, shape: tuple[int, ...], layer: int | None) -> WriteItem:
        offsets = torch.Size((0,) * len(shape)) if layer is None else torch.Size((layer,) + (0,) * (len(shape) - 1))
        sizes = torch.Size(shape) if layer is None else torch.Size((1, *shape[1:]))
        name = self.layer_keys[key][0] if key in self.layer_keys else key
        data = TensorWriteData(
            ChunkStorageMetadata(offsets, sizes), TensorProperties(dtype=self.model.dtype_of(name)), torch.Size(shape)
        )
        return WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD, tensor_data=data)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return self.transform_object(write_item, [None])  # Transformer Engine's empty extra state
        if key in self.layer_keys:
            name, layer = self.layer_keys[key]
            if layer is not None:
                return self.model.layer(name, layer)
            return self.model.layer(name, write_item.index.offset[0]).unsqueeze(0)
        return self.model.other(key)


def write_torch_dist(directory: Path, model: MegatronModel, args: Namespace, iteration: int, spec: Spec) -> None:
    """megatron-core's torch_dist checkpoint of ``model`` in ``directory``."""
    writer = FileSystemWriter(str(directory), single_file_per_rank=False)
    dcp_save({}, directory, writer=writer, planner=LayerChunkSavePlanner(model, spec))
    common = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": CONTENT_METADATA,
    }
    torch.save(common, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(BACKEND))


def rank_state(
    model: MegatronModel, layout: Layout, tp_rank: int, pp_rank: int, ep_rank: int = 0
) -> dict[str, torch.Tensor | None]:
    """The model state of one legacy rank file: its shards of its stage's layers (numbered from
    0 in the stage) under the layer spec's names, of its expert-parallel rank's experts
    (numbered from 0), and of the embedding (first stage) or final norm and output layer (last
    stage)."""
    config, tp = model.config, layout.tp
    layers = config.num_hidden_layers // layout.pp
    local_experts = config.num_experts // layout.ep
    state: dict[str, torch.Tensor | None] = {}
    if pp_rank == 0:
        state[EMBEDDING] = split_shards(EMBEDDING, model.other(EMBEDDING), tp)[tp_rank].clone()
    for local in range(layers):
        i, prefix = pp_rank * layers + local, f"{LAYERS}{local}."
        for name in layer_tensors(config, i):
            tensor = model.layer(name, i)
            if name in EXPERTS:
                for j in range(local_experts):
                    expert = tensor[ep_rank * local_experts + j]
                    state[prefix + legacy_expert_name(name, j, layout.grouped)] = split_shards(name, expert, tp)[
                        tp_rank
                    ].clone()
            else:
                state[prefix + stored_name(name, config, i, layout.spec, legacy=True)] = split_shards(
                    name, tensor, tp, layout.spec
                )[tp_rank].clone()
        for module in extra_state_modules(config, i):
            state[f"{prefix}{module}._extra_state"] = None
        if config.is_moe_layer(i):
            for linear in ("linear_fc1", "linear_fc2"):
                if layout.grouped:  # one Transformer Engine GroupedLinear for every local expert
                    state[f"{prefix}mlp.experts.{linear}._extra_state"] = None
                else:
                    state.update(
                        {
                            f"{prefix}mlp.experts.local_experts.{j}.{linear}._extra_state": None
                            for j in range(local_experts)
                        }
                    )
    if pp_rank == layout.pp - 1:
        state[FINAL_NORM] = model.other(FINAL_NORM)
        if not config.tie_word_embeddings or layout.pp > 1:  # a shared embedding's copy on the last stage
            source = EMBEDDING if config.tie_word_embeddings else OUTPUT
            state[OUTPUT] = split_shards(OUTPUT, model.other(source), tp)[tp_rank].clone()
        state["output_layer._extra_state"] = None
    return state


def write_legacy(directory: Path, model: MegatronModel, args: Namespace, iteration: int, layout: Layout) -> None:
    """Megatron-LM's legacy per-rank checkpoint of ``model`` in ``directory``, one rank at a time."""
    for pp_rank in range(layout.pp):
        for ep_rank in range(layout.ep):
            for tp_rank in range(layout.tp):
                rank_dir = directory / rank_dir_name(tp_rank, pp_rank, ep_rank, layout.pp > 1, layout.ep > 1)
                rank_dir.mkdir(parents=True)
                state = {
                    "args": args,
                    "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": iteration,
                    "model": rank_state(model, layout, tp_rank, pp_rank, ep_rank),
                    "num_floating_point_operations_so_far": 0,
                }
                torch.save(state, rank_dir / LEGACY_FILE)


def check_layout(config: ModelConfig, layout: Layout) -> None:
    """Raise, naming the option, when the model cannot be split or named as ``layout`` asks."""
    if reason := unmapped_layers(config):
        raise CheckpointError(f"--megatron: {reason}")
    if biases := missing_biases(config):
        raise CheckpointError(
            f"--megatron: the model has {biases}, which Megatron's layout (q/k/v biases only) cannot hold"
        )
    if config.num_hidden_layers % layout.pp:
        raise CheckpointError(
            f"--pp {layout.pp}: the model's {config.num_hidden_layers} layers do not split evenly "
            f"into {layout.pp} pipeline stages (Megatron-LM's default split)"
        )
    widths = [("attention heads", config.num_attention_heads), ("query groups", config.num_key_value_heads)]
    if config.kv_lora_rank and layout.spec == "local":  # the local spec splits MLA's down projections' rows
        widths.append(
            (
                "key/value latent and rotary rows (kv_lora_rank + qk_rope_head_dim)",
                config.kv_lora_rank + config.qk_rope_head_dim,
            )
        )
        if config.q_lora_rank is not None:
            widths.append(("query latent rows (q_lora_rank)", config.q_lora_rank))
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        widths.append(("feed-forward width", config.intermediate_size))
    if config.num_experts:  # megatron-core splits experts over tensor-parallel ranks as dense layers
        widths.append(("expert width (moe_intermediate_size)", config.moe_intermediate_size))
        if config.shared_expert_intermediate_size:
            widths.append(("shared expert width", config.shared_expert_intermediate_size))
    for name, count in widths:
        if count % layout.tp:
            raise CheckpointError(f"--tp {layout.tp}: the model's {count} {name} do not divide among {layout.tp} ranks")
    if layout.ep > 1 and not config.num_experts:
        raise CheckpointError(f"--ep {layout.ep}: the model ({config.model_type}) has no experts to divide")
    if config.num_experts % layout.ep:
        raise CheckpointError(
            f"--ep {layout.ep}: the model's {config.num_experts} experts do not divide among "
            f"{layout.ep} expert-parallel ranks"
        )
    if layout.grouped and not config.num_experts:
        raise CheckpointError(f"--moe-grouped-gemm: the model ({config.model_type}) has no experts")
    if layout.grouped and layout.legacy and layout.spec == "local":
        raise CheckpointError(
            "--moe-grouped-gemm with --megatron-spec local and --megatron-format legacy: the local "
            "spec keeps grouped experts in megatron-core's legacy GroupedMLP (mlp.experts.weight1/"
            "weight2), which llmflow does not write; use the transformer_engine spec (TEGroupedMLP)"
        )


def write_megatron(
    work: Path, config: ModelConfig, load: Load, layout: Layout, iteration: int, vocab_multiple: int, dtype: torch.dtype
) -> int:
    """The checkpoint root in ``work``: ``iter_{iteration:07d}`` in the chosen format and its
    tracker file, every tensor in ``dtype``. Returns the padded vocabulary."""
    check_layout(config, layout)
    padded = padded_vocab_size(config.vocab_size, vocab_multiple * layout.tp)  # Megatron-LM's _vocab_size_with_padding
    model = MegatronModel(config, load, padded, dtype)
    args = megatron_args(config, layout, padded, vocab_multiple, iteration, dtype)
    directory = work / f"iter_{iteration:07d}"
    if layout.legacy:
        write_legacy(directory, model, args, iteration, layout)
    else:
        directory.mkdir(parents=True)
        write_torch_dist(directory, model, args, iteration, layout.spec)
    (work / TRACKER).write_text(str(iteration))
    return padded
