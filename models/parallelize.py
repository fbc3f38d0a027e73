"""Parallel plans for the decoder, applied from outside the model.

- ``apply_tp``: tensor parallel with DTensor and a sequence-parallel plan (Megatron's
  column/row split of attention and MLP; norms and the residual stream sharded along the
  sequence). Every parameter becomes a DTensor, so gradient clipping and checkpoints see
  one kind of tensor. The embedding and the output projection stay whole on every rank of
  the tensor-parallel group: the fused cross-entropy then runs on full rows.
  A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) is split by key-head groups
  (``linear_layer_tp_plan``), each rank holding whole key heads and their value heads; a
  Multi-head Latent Attention layer (DeepSeek-V3) by heads after its low-rank down
  projections, which every rank holds whole (``latent_layer_tp_plan``).
- ``apply_tp_inference``: tensor parallel for generation: the same column/row split of
  attention and MLP, with replicated activations between the layers (no sequence sharding),
  so the KV cache holds each rank's own heads.
- ``apply_ep`` (``expert_parallel.py``): the experts of every MoE layer split over the
  expert-parallel ranks, tokens sent to their experts' ranks and back by all-to-all.
- ``apply_cp`` (``context_parallel.py``): context parallel (Ulysses), each rank holding a
  contiguous shard of every sequence and attention trading it for a shard of the heads.
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
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmflow.models.blocks.mla import MultiHeadLatentAttention
from llmflow.models.config import ModelConfig, inference_tp_problems
from llmflow.models.context_parallel import apply_cp
from llmflow.models.decoder import CausalLM
from llmflow.models.expert_parallel import apply_ep, expert_parameters
from llmflow.models.lora import LoraLinear, is_lora_param
from llmflow.models.lora_parallel import lora_tp_plan


def layer_tp_plan(config: ModelConfig) -> dict[str, ParallelStyle]:
    """The sequence-parallel plan of one attention decoder layer of ``config``, keyed by HF
    module names (``linear_layer_tp_plan`` turns it into a Gated DeltaNet layer's).

    Per-head q/k norms (Qwen3) see this rank's heads ([B, S, heads, head_dim] sharded on dim
    2) and keep their [head_dim] weight whole on every rank, a replicated DTensor whose
    gradient is summed over the ranks' heads. A gated attention's ``q_proj`` (Qwen3-Next,
    Qwen3.5) emits each head's queries and then its gate values, head after head, so its
    column split (contiguous rows of whole heads) keeps each head's queries and gate on the
    same rank. Sandwich norms (Gemma 3) normalise o_proj's and down_proj's outputs, this rank's
    sequence shards, and hand plain tensors to the residual add."""
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": HeadSplitAttention(PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )),
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
    if config.sandwich_norms:  # post_attention_layernorm then normalises o_proj's output, not the MLP's input
        plan["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
        plan["pre_feedforward_layernorm"] = SequenceParallel()
        plan["post_feedforward_layernorm"] = SequenceParallel(use_local_output=True)
    return plan


def linear_layer_tp_plan(plan: dict[str, ParallelStyle], fused_projections: bool) -> dict[str, ParallelStyle]:
    """``plan`` for a layer whose token mixer is a Gated DeltaNet (``linear_attn``): split by
    key-head groups, each rank holding whole key heads and the value heads they serve (see
    ``GatedDeltaNetParallel``); ``fused_projections``: Qwen3-Next's ``in_proj_qkvz`` and
    ``in_proj_ba``, grouped per key head, so that their plain column split gives each rank
    whole key heads."""
    linear = {name: style for name, style in plan.items() if name != "self_attn" and not name.startswith("self_attn.")}
    projections = ("in_proj_qkvz", "in_proj_ba") if fused_projections else ("in_proj_z", "in_proj_b", "in_proj_a")
    linear["linear_attn"] = GatedDeltaNetParallel()
    linear.update({f"linear_attn.{name}": ColwiseParallel() for name in projections})
    linear["linear_attn.norm"] = PerHeadNormParallel()
    linear["linear_attn.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return linear


def latent_layer_tp_plan(plan: dict[str, ParallelStyle], low_rank_query: bool) -> dict[str, ParallelStyle]:
    """``plan`` for a layer whose token mixer is Multi-head Latent Attention (``self_attn``):
    ``q_b_proj`` (``q_proj`` when ``low_rank_query`` is false) and ``kv_b_proj`` column-parallel
    over the heads, ``o_proj`` row-parallel; the down projections ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` and their norms replicated (``ReplicateParallel``), computed whole
    by every rank from the input ``LatentAttentionParallel`` gathers."""
    latent = _without_attention(plan)
    latent["self_attn"] = LatentAttentionParallel()
    down = (*(("q_a_proj", "q_a_layernorm") if low_rank_query else ()), "kv_a_proj_with_mqa", "kv_a_layernorm")
    latent.update({f"self_attn.{name}": ReplicateParallel() for name in down})
    latent.update(_latent_head_split(low_rank_query, RowwiseParallel(output_layouts=Shard(1))))
    return latent


def latent_inference_layer_tp_plan(plan: dict[str, ParallelStyle], low_rank_query: bool) -> dict[str, ParallelStyle]:
    """``inference_layer_tp_plan`` for a Multi-head Latent Attention layer: the same split of its
    heads as ``latent_layer_tp_plan``'s, everything else plain tensors on every rank."""
    return {**_without_attention(plan), **_latent_head_split(low_rank_query, RowwiseParallel())}


def _without_attention(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    return {name: style for name, style in plan.items() if not name.startswith("self_attn.")}


def _latent_head_split(low_rank_query: bool, output: RowwiseParallel) -> dict[str, ParallelStyle]:
    query = "self_attn.q_b_proj" if low_rank_query else "self_attn.q_proj"
    return {query: ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel(), "self_attn.o_proj": output}


class HeadSplitAttention(ParallelStyle):
    """Attention (``self_attn``) under a plan that splits its heads: its learned sinks, one logit
    per query head (gpt-oss), split with them (``Shard(0)``, each rank its heads' in the order
    ColwiseParallel gives ``q_proj``'s rows), and its input laid out by ``prepare`` when given."""

    def __init__(self, prepare: PrepareModuleInput | None = None) -> None:
        super().__init__()
        self.prepare = prepare

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            split = distribute_tensor(sinks.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.sinks = nn.Parameter(split, requires_grad=sinks.requires_grad)
        return self.prepare._apply(module, device_mesh) if self.prepare is not None else module


class LatentAttentionParallel(ParallelStyle):
    """Multi-head Latent Attention (``self_attn``) itself under the layer plan: its input
    gathered from the sequence shards like attention's, and its rotary key part, which every
    head shares, given its gradient summed over the ranks (each rank's heads give only theirs),
    so that the replicated down projection and the input get the whole gradient on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MultiHeadLatentAttention):
            raise TypeError(f"LatentAttentionParallel applies to a MultiHeadLatentAttention, not {type(module).__name__}")
        module.shared_key_gradient = partial(_gradient_summed, mesh=device_mesh)
        prepare = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                     desired_input_layouts=(Replicate(), None, None, None), use_local_output=True)
        return prepare._apply(module, device_mesh)


def _gradient_summed(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` as it is, its gradient summed over the ranks of ``mesh``."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class ReplicateParallel(ParallelStyle):
    """A module whole on every rank: its parameters replicated DTensors, its input and output
    this rank's plain tensors (the same on every rank), its gradients computed alike by each."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_inputs, output_fn=_local_output)


def _replicated_inputs(_module: nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh) -> tuple[DTensor, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(_module: nn.Module, output: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


class HeadGroupRows:
    """This tensor-parallel rank's rows of a Gated DeltaNet's ``[q | k | v]`` concatenation
    (``in_proj_qkv``'s output and ``conv1d``'s channels): its key heads' slice of q and of k,
    then their value heads' slice of v.

    Those rows are three separate slices of the stored tensor, which no DTensor placement
    describes, so the weights keep the plain row split (``Shard(0)``: checkpoints, sharded
    loading and DCP see the Hugging Face layout whatever tp is) and each forward gathers the
    whole weight and takes this rank's rows (``rows``); the gradient goes back to the shards by a
    reduce-scatter, each rank contributing its own rows. That is one all-gather of
    ``in_proj_qkv`` and of ``conv1d`` per layer and step (as FSDP gathers every weight), and
    the arithmetic of each head is the single process's."""

    def __init__(self, mesh: DeviceMesh, key_dim: int, value_dim: int) -> None:
        tp, rank = mesh.size(), mesh.get_local_rank()
        self.mesh = mesh
        self.spans = tuple((start + rank * (size // tp), size // tp)
                           for start, size in ((0, key_dim), (key_dim, key_dim), (2 * key_dim, value_dim)))

    def rows(self, weight: DTensor) -> torch.Tensor:
        """This rank's rows of ``weight`` (a row-split DTensor), a plain tensor."""
        whole = weight.full_tensor(grad_placements=[Partial()])
        return torch.cat([whole.narrow(0, start, size) for start, size in self.spans])

    def _rows_dtensor(self, weight: DTensor) -> DTensor:
        return DTensor.from_local(self.rows(weight), self.mesh, [Shard(0)], run_check=False)

    def linear(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``proj(x)`` (``in_proj_qkv``, LoRA adapter included) for this rank's rows, from the
        whole input ``x``; the input's gradient summed over the ranks, as ColwiseParallel's."""
        x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        out = F.linear(x, self._rows_dtensor(proj.weight))
        if isinstance(proj, LoraLinear):  # lora_A whole on every rank, lora_B split like the weight
            low = F.linear(proj.lora_dropout(x), proj.lora_A.weight)
            out = out + F.linear(low, self._rows_dtensor(proj.lora_B.weight)) * proj.scaling
        return out.to_local()

    @staticmethod
    def local(param: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a per-value-head parameter (A_log, dt_bias)."""
        return param.to_local()


class GatedDeltaNetParallel(ParallelStyle):
    """The Gated DeltaNet (``linear_attn``) itself under the layer plan: its input gathered
    from the sequence shards like attention's; ``in_proj_qkv`` (with its LoRA adapter) and
    ``conv1d`` split by rows and computed for this rank's head group (``HeadGroupRows``);
    ``A_log`` and ``dt_bias`` split per value head. Its other projections, norm and
    ``out_proj`` have their own entries in the plan."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from llmflow.models.blocks.gated_deltanet import GatedDeltaNet

        if not isinstance(module, GatedDeltaNet):
            raise TypeError(f"GatedDeltaNetParallel applies to a GatedDeltaNet, not {type(module).__name__}")
        tp = device_mesh.size()
        if module.num_key_heads % tp:
            raise ValueError(f"{module.num_key_heads} linear-attention key heads cannot be split over tp={tp}")
        key_dim = module.num_key_heads * module.key_head_dim
        module.tensor_parallel = HeadGroupRows(device_mesh, key_dim, module.num_value_heads * module.value_head_dim)
        split = [(module, "A_log"), (module, "dt_bias"), (module.conv1d, "weight")]
        if not module.fused_projections:
            proj = module.in_proj_qkv
            split.append((proj, "weight"))
            if isinstance(proj, LoraLinear):
                split.append((proj.lora_B, "weight"))
                self._distribute(proj.lora_A, "weight", device_mesh, Replicate())
        for owner, name in split:
            self._distribute(owner, name, device_mesh, Shard(0))
        prepare = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                     desired_input_layouts=(Replicate(), None, None, None), use_local_output=True)
        return prepare._apply(module, device_mesh)

    def _distribute(self, owner: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
        param = getattr(owner, name)
        tensor = distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank)
        owner.register_parameter(name, nn.Parameter(tensor, requires_grad=param.requires_grad))


class PerHeadNormParallel(ParallelStyle):
    """A Gated DeltaNet's gated RMSNorm: its inputs (the heads' outputs and gates,
    [B, S, heads, head_dim]) are this rank's heads (sharded on dim 2); its [head_dim] weight
    whole on every rank, a replicated DTensor whose gradient is summed over the ranks' heads
    (SequenceParallel does this for q/k norms, but passes on only one input)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_heads(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in inputs)

        def to_local(_module, output, _mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_heads, output_fn=to_local)


def _replicate_embedding(embed: nn.Embedding, mesh: DeviceMesh) -> None:
    """Whole embedding on every rank; its output enters the sequence-parallel region."""

    def to_sequence_shard(_module, output, device_mesh):
        return output.redistribute(device_mesh, [Shard(1)]).to_local()

    distribute_module(embed, mesh, input_fn=_replicated_inputs, output_fn=to_sequence_shard)


def _replicate_output_projection(lm_head: nn.Linear, mesh: DeviceMesh, distribute_weight: bool) -> None:
    keep = None if distribute_weight else (lambda _name, _module, _mesh: None)
    distribute_module(lm_head, mesh, partition_fn=keep, input_fn=_replicated_inputs, output_fn=_local_output)


def moe_layer_tp_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` for a layer whose feed-forward block is a mixture of experts: the block takes
    this rank's shard of the sequence as it is (its router, experts and shared expert whole
    on every rank, each rank routing its own tokens; their gradients are summed over the ranks
    by the training loop) and returns the same shard."""
    moe = {name: style for name, style in plan.items() if name != "mlp" and not name.startswith("mlp.")}
    moe["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    return moe


def apply_tp(model: CausalLM, mesh: DeviceMesh, lora: bool = False) -> None:
    """Shard ``model`` over the 1-D tensor-parallel ``mesh`` in place, each layer by the plan
    of its kind (attention or Gated DeltaNet, dense or MoE feed-forward); ``lora``: the plans
    made for a model with LoRA adapters (``lora_tp_plan``)."""
    decoder = model.model
    config = model.config
    for name, layer in decoder.layers.items():
        index = int(name)  # the layer's number in the whole model, also in a pipeline stage
        plan = layer_tp_plan(config)
        if config.is_linear_layer(index):
            plan = linear_layer_tp_plan(plan, layer.linear_attn.fused_projections)
        if isinstance(attention := getattr(layer, "self_attn", None), MultiHeadLatentAttention):
            plan = latent_layer_tp_plan(plan, attention.low_rank_query)
        if config.is_moe_layer(index):
            plan = moe_layer_tp_plan(plan)
        parallelize_module(layer, mesh, lora_tp_plan(plan) if lora else plan)
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
    whole. Norms, embedding and output projection stay plain tensors on every rank, and so
    does a mixture of experts (``apply_tp_inference`` drops the MLP entries from its layers).

    Not the sequence-parallel plan of training: a decoding step feeds one token per row,
    which cannot be split along the sequence, and sequence parallelism only saves
    activation memory that inference does not keep. Here every layer's input and output are
    replicated plain tensors (one all-reduce after o_proj and one after down_proj), and
    k/v come out of their projections as this rank's heads only, which is what the KV cache
    stores (it sizes its buffers from the first keys it is given)."""
    return {
        "self_attn": HeadSplitAttention(),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def apply_tp_inference(model: CausalLM, mesh: DeviceMesh) -> None:
    """Shard ``model`` for generation over the 1-D tensor-parallel ``mesh`` in place (see
    ``inference_layer_tp_plan``). Sharding a model on the meta device only records the
    layout, so its shards can then be allocated without ever holding the whole model."""
    if problems := inference_tp_problems(model.config, mesh.size()):
        raise NotImplementedError(problems[0])
    for name, layer in model.model.layers.items():
        plan = inference_layer_tp_plan()
        if model.config.is_moe_layer(int(name)):  # the experts whole on every rank, as in training
            plan = {key: style for key, style in plan.items() if not key.startswith("mlp.")}
        if isinstance(attention := getattr(layer, "self_attn", None), MultiHeadLatentAttention):
            plan = latent_inference_layer_tp_plan(plan, attention.low_rank_query)
        parallelize_module(layer, mesh, plan)


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

    # Grad mode is off inside an autograd.Function's forward (the gated delta rule's torch path,
    # kernels/gated_delta.py): its matrix multiplications are intermediates its backward
    # recomputes from what it saves itself, so keeping them would hold per-chunk products a
    # layer without checkpointing never keeps.
    heavy = op in SAVED_OPS and torch.is_grad_enabled()
    return CheckpointPolicy.MUST_SAVE if heavy else CheckpointPolicy.PREFER_RECOMPUTE


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
    cp_algo: str = "ulysses",
) -> None:
    """Shard ``model`` (the whole model or one pipeline stage) for training over ``mesh`` (dims
    "pp", "dp" and "tp", "ep" under expert parallelism and "cp" under context parallelism;
    None in a single process), in place: expert parallel over "ep", tensor parallel when the
    "tp" dimension is larger than 1 (LoRA's adapters split with the weights they adapt),
    context parallel over "cp" by ``cp_algo``, activation checkpointing, compilation, then FSDP2 over "dp"
    (over "dp_cp", dp and cp flattened, under context parallelism) computing in
    ``fsdp_dtype`` (None: no FSDP; see ``apply_fsdp`` for ``reshard_after_forward``)."""
    dims = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "ep" in dims:
        apply_ep(model, mesh["ep"])
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], lora=lora)
        if lora:  # SequenceParallel makes fresh, trainable norm weights
            for name, param in model.named_parameters():
                param.requires_grad_(is_lora_param(name))
    if "cp" in dims:
        apply_cp(model, mesh["cp"], cp_algo)
    if activation_checkpointing != "none":
        apply_ac(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    if fsdp_dtype is not None:
        if mesh is None:
            raise ValueError("FSDP needs a device mesh (a torchrun launch)")
        apply_fsdp(model, mesh["dp_cp" if "cp" in dims else "dp"], param_dtype=fsdp_dtype,
                   reshard_after_forward=reshard_after_forward)
