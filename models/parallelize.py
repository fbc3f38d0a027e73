"""Parallel plans for the decoder, applied from outside the model.

- ``apply_tp``: tensor parallel with DTensor and a sequence-parallel plan (Megatron's
  column/row split of attention and MLP; norms and the residual stream sharded along the
  sequence). Every parameter becomes a DTensor, so gradient clipping and checkpoints see
  one kind of tensor. The embedding and the output projection stay whole on every rank of
  the tensor-parallel group: the fused cross-entropy then runs on full rows.
- ``apply_tp_inference``: tensor parallel for generation: the same column/row split of
  attention and MLP, with replicated activations between the layers (no sequence sharding),
  so the KV cache holds each rank's own heads.
- ``apply_ep`` (``expert_parallel.py``): the experts of every MoE layer split over the
  expert-parallel ranks, tokens sent to their experts' ranks and back by all-to-all.
- ``apply_ac``: activation checkpointing of every decoder layer.
- ``apply_compile``: ``torch.compile`` of every decoder layer.
- ``apply_fsdp``: FSDP2 ``fully_shard`` of every layer and of the root (the split experts
  left out) over the data-parallel mesh, with a mixed-precision policy (bf16 compute, fp32 master weights
  and gradient reduction) on accelerators.

Training calls one entry point, ``parallelize_decoder``, which applies them in that order
(LoRA adapters, if any, are added before it). Generation calls ``apply_tp_inference``.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmflow.models.config import ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.models.expert_parallel import apply_ep, expert_parameters
from llmflow.models.lora import is_lora_param
from llmflow.models.lora_parallel import lora_tp_plan


def layer_tp_plan(config: ModelConfig) -> dict[str, ParallelStyle]:
    """The sequence-parallel plan of one decoder layer of ``config``, keyed by HF module names.

    Per-head q/k norms (Qwen3) see this rank's heads ([B, S, heads, head_dim] sharded on dim
    2) and keep their [head_dim] weight whole on every rank, a replicated DTensor whose
    gradient is summed over the ranks' heads."""
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if config.qk_norm:
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _replicate_embedding(embed: nn.Embedding, mesh: DeviceMesh) -> None:
    """Whole embedding on every rank; its output enters the sequence-parallel region."""

    def to_replicated(_module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) for x in inputs)

    def to_sequence_shard(_module, output, device_mesh):
        return output.redistribute(device_mesh, [Shard(1)]).to_local()

    distribute_module(embed, mesh, input_fn=to_replicated, output_fn=to_sequence_shard)


def _replicate_output_projection(lm_head: nn.Linear, mesh: DeviceMesh, distribute_weight: bool) -> None:
    def to_replicated(_module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(_module, output, _device_mesh):
        return output.to_local()

    keep = None if distribute_weight else (lambda _name, _module, _mesh: None)
    distribute_module(lm_head, mesh, partition_fn=keep, input_fn=to_replicated, output_fn=to_local)


def moe_layer_tp_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` for a layer whose feed-forward block is a mixture of experts: the block takes
    this rank's shard of the sequence as it is (its router, experts and shared expert whole
    on every rank, each rank routing its own tokens; their gradients are summed over the ranks
    by the training loop) and returns the same shard."""
    moe = {name: style for name, style in plan.items() if name != "mlp" and not name.startswith("mlp.")}
    moe["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    return moe


def apply_tp(model: CausalLM, mesh: DeviceMesh, extra_layer_plan: dict[str, ParallelStyle] | None = None) -> None:
    """Shard ``model`` over the 1-D tensor-parallel ``mesh`` in place. ``extra_layer_plan``
    adds entries to every layer's plan (LoRA adapters)."""
    _refuse_linear_attention(model)
    decoder = model.model
    plan = {**layer_tp_plan(model.config), **(extra_layer_plan or {})}
    for name, layer in decoder.layers.items():
        parallelize_module(layer, mesh, moe_layer_tp_plan(plan) if model.config.is_moe_layer(int(name)) else plan)
    if decoder.embed_tokens is not None:
        _replicate_embedding(decoder.embed_tokens, mesh)
    if decoder.norm is not None:
        parallelize_module(decoder.norm, mesh, SequenceParallel())
        parallelize_module(
            decoder, mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
        )
    if model.lm_head is not None:
        tied = model.config.tie_word_embeddings and decoder.embed_tokens is not None
        if tied:
            model.lm_head.weight = decoder.embed_tokens.weight  # already distributed with the embedding
        _replicate_output_projection(model.lm_head, mesh, distribute_weight=not tied)


def inference_layer_tp_plan() -> dict[str, ParallelStyle]:
    """The generation plan of one decoder layer: attention heads and FFN columns split
    across ranks (q/k/v and gate/up column-parallel, o/down row-parallel), everything else
    whole. Norms, embedding and output projection stay plain tensors on every rank.

    Not the sequence-parallel plan of training: a decoding step feeds one token per row,
    which cannot be split along the sequence, and sequence parallelism only saves
    activation memory that inference does not keep. Here every layer's input and output are
    replicated plain tensors (one all-reduce after o_proj and one after down_proj), and
    k/v come out of their projections as this rank's heads only, which is what the KV cache
    stores (it sizes its buffers from the first keys it is given)."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _refuse_linear_attention(model: CausalLM) -> None:
    """The plans shard attention heads; a Gated DeltaNet layer's heads have no plan yet."""
    if "linear_attention" in model.config.layer_types:
        raise NotImplementedError(f"{model.config.model_type}: tensor parallelism of Gated DeltaNet (linear "
                                  "attention) layers is not supported; run with tp=1")


def apply_tp_inference(model: CausalLM, mesh: DeviceMesh) -> None:
    """Shard ``model`` for generation over the 1-D tensor-parallel ``mesh`` in place (see
    ``inference_layer_tp_plan``). Sharding a model on the meta device only records the
    layout, so its shards can then be allocated without ever holding the whole model."""
    _refuse_linear_attention(model)
    for layer in model.model.layers.values():
        parallelize_module(layer, mesh, inference_layer_tp_plan())


# What selective checkpointing keeps from the forward pass: the outputs of the ops whose
# recomputation costs most (matrix multiplications and attention, as torchtitan's op-level
# policy); everything else in a layer is recomputed in backward.
SAVED_OPS = frozenset(
    op
    for name in ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")
    if (op := getattr(getattr(torch.ops.aten, name, None), "default", None)) is not None
)


def _keep_heavy_ops(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: CausalLM, mode: str = "full") -> None:
    """Activation checkpointing of every decoder layer: ``full`` recomputes the whole layer in
    the backward pass from its input; ``selective`` keeps the outputs of ``SAVED_OPS`` and
    recomputes the rest."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing {mode!r}: expected full or selective")
    options = {} if mode == "full" else {"context_fn": partial(create_selective_checkpoint_contexts, _keep_heavy_ops)}
    layers = model.model.layers
    for name, layer in list(layers.items()):
        layers[name] = checkpoint_wrapper(layer, preserve_rng_state=True, **options)


def apply_fsdp(model: CausalLM, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True) -> None:
    """FSDP2 over the data-parallel ``mesh``: one unit per layer, the rest in the root; the
    experts expert parallelism split stay out of it (``models/expert_parallel.py``).
    ``reshard_after_forward=False`` keeps each layer gathered from its forward to its backward
    (pipeline stages, whose schedule runs several forwards before the backwards)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ignored = set(expert_parameters(model)) or None
    layers = list(model.model.layers.values())
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them.
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                    reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)


def apply_compile(model: CausalLM) -> None:
    """Compile each decoder layer (one graph per layer, reused by all of them)."""
    for layer in model.model.layers.values():
        layer.compile()


def parallelize_decoder(
    model: CausalLM,
    mesh: DeviceMesh | None,
    *,
    lora: bool = False,
    activation_checkpointing: str = "none",
    compile: bool = False,
    fsdp_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Shard ``model`` (the whole model or one pipeline stage) for training over ``mesh`` (dims
    "pp", "dp" and "tp", and "ep" under expert parallelism; None in a single process), in
    place: tensor parallel when the "tp" dimension is larger than 1 (LoRA's adapters split
    with the weights they adapt), expert parallel over "ep", activation checkpointing,
    compilation, then FSDP2 over "dp" computing in ``fsdp_dtype`` (None: no FSDP; see
    ``apply_fsdp`` for ``reshard_after_forward``)."""
    if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
        apply_ep(model, mesh["ep"])
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], lora_tp_plan(layer_tp_plan(model.config)) if lora else None)
        if lora:  # SequenceParallel makes fresh, trainable norm weights
            for name, param in model.named_parameters():
                param.requires_grad_(is_lora_param(name))
    if activation_checkpointing != "none":
        apply_ac(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    if fsdp_dtype is not None:
        if mesh is None:
            raise ValueError("FSDP needs a device mesh (a torchrun launch)")
        apply_fsdp(model, mesh["dp"], param_dtype=fsdp_dtype, reshard_after_forward=reshard_after_forward)
