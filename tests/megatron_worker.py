"""Real megatron-core checkpoints for the converter tests, made and read by megatron-core itself on CPU.

A worker of one process per tp x pp rank (gloo, CPU; no data parallelism), as a torchrun script
or, in the tests, ``main(argv)`` on ranks forked with megatron-core already imported
(``forked_workers.py``)::

    python -m torch.distributed.run --nproc-per-node N tests/megatron_worker.py make \\
        --config CONFIG_JSON --tp T --pp P --iteration I --out ROOT [--legacy] [--seed S] [--ids IDS_PT]
    python -m torch.distributed.run --nproc-per-node N tests/megatron_worker.py load \\
        --load CKPT_ROOT --tp T --pp P [--ep E] --out ROOT [--ids IDS_PT] [--vocab-size V] [--resave] [--legacy]

``make`` builds the megatron-core GPTModel (local spec) that a Llama or Qwen2 Hugging Face
config.json describes, fills it with deterministic global tensors seeded by each tensor's sharded
key (so every tp/pp layout holds the same global values; padded vocab rows are zero), and saves it
as Megatron-LM's ``save_checkpoint`` does with ``--ckpt-format torch_dist --no-save-optim
--no-save-rng``: ROOT/torch_dist/iter_{I:07d}/ plus ROOT/torch_dist/latest_checkpointed_iteration.txt.
``--legacy`` also writes the ``--ckpt-format torch`` layout
ROOT/legacy/iter_{I:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt (+ its tracker file).

``load`` builds the GPTModel that a torch_dist checkpoint's ``args`` describe at any tp/pp (and,
for a mixture of experts, ep: then N = tp * pp * ep, the data-parallel size being ep), fills it
with megatron-core's ``dist_checkpointing.load`` at the default strictness and, with
``--resave``, saves it again with ``dist_checkpointing.save`` (same args and iteration) into
ROOT/torch_dist/; with ``--legacy`` also as ROOT/legacy/ (rank directories
mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}], as Megatron-LM names them).

A mixture of experts (``args.num_experts``) is built with megatron-core's decoder block spec
(``get_gpt_decoder_block_spec``, local modules: SequentialMLP experts, the router with its
score function, groups, scaling and expert bias, shared experts with or without their gate,
dense layers by ``moe_layer_freq``). Multi-head Latent Attention (``args.multi_latent_attention``)
is built from ``MLATransformerConfig`` (its head widths, latent ranks and plain or YaRN rotary
from ``args``) with the local spec's ``MLASelfAttention`` and its latent norms. Transformer
Engine is not installed here, so the Transformer Engine spec itself cannot be built; a
checkpoint whose ``args.transformer_impl`` is ``transformer_engine`` is loaded into local
modules that take the torch_dist names the two specs give differently (``use_te_names``): a MoE
layer's post-attention norm, which the TE spec stores as ``pre_mlp_layernorm.weight`` and the
local spec renames (its ``sharded_state_dict_keys_map``) to ``mlp.linear_fc1.layer_norm_weight``;
and in MLA layers, which the local spec does not rename, the latent norms the TE spec fuses
into the up projections (``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``)
and a dense layer's post-attention norm (``mlp.linear_fc1.layer_norm_weight``).

megatron-core 0.16.1's local spec cannot build its own MLA layer: ``MLASelfAttention`` passes
``k_channels`` and ``v_channels`` to the core attention, which the local ``DotProductAttention``
does not take (Transformer Engine's does). Its computation takes the head widths from q, k and
v themselves and lays the output out by ``kv_channels`` per head, which the args set to
``v_head_dim``; ``MLACoreAttention`` takes the two arguments and checks that, and the worker's
MLA layers use it.

Both then run megatron-core's forward on the ids in IDS_PT (a LongTensor [B, S]; by default seed-0
random ids [2, 16]) and write ROOT/logits.pt = {"input_ids", "logits": float32 [B, S, vocab]}
with the padded vocab columns dropped.

megatron-core 0.16.1 calls CUDA on these paths even with ``use_cpu_initialization``:
``torch.cuda.synchronize()`` and a failure flag on ``torch.cuda.current_device()`` in the torch_dist
save, ``torch.cuda.current_device()`` for the rotary frequencies in the forward, and
``Tensor.cuda()`` in the tied-embedding all-reduce across pipeline stages. ``install_cpu_shims``
maps those to CPU inside this worker; megatron-core itself is unchanged. Two more CUDA paths are
avoided instead: the default causal mask (``device="cuda"``) by passing an explicit mask, and
``CudaRNGStatesTracker`` by megatron-core's inference RNG tracker. Without Transformer Engine,
megatron-core's ``moe_utils`` leaves ``te_general_gemm`` (and its other fused MoE functions)
undefined instead of None, so the router's forward fails with a NameError;
``install_cpu_shims`` defines them as None, which is what megatron-core tests for. And
``multi_latent_attention`` imports Transformer Engine's placeholders (mocks) without failing,
so it believes Transformer Engine installed (``HAVE_TE``) and tests its output projection
against a mock class, a TypeError; ``install_cpu_shims`` sets its ``HAVE_TE`` to False.
"""

from __future__ import annotations

import argparse
import json
import zlib
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

TRACKER = "latest_checkpointed_iteration.txt"
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
# Megatron-LM's _build_sharded_state_dict_metadata without a distributed optimizer; it is stored
# as the checkpoint's content metadata and passed (with the DP group) to sharded_state_dict.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
# The architecture flags this worker builds, by their Megatron-LM argument names.
FIXED_ARGS: dict[str, Any] = {
    "position_embedding_type": "rope",
    "use_rotary_position_embeddings": True,
    "rotary_interleaved": False,
    "normalization": "RMSNorm",
    "apply_layernorm_1p": False,
    "swiglu": True,
    "add_bias_linear": False,
}
# moe_utils' names bound only when Transformer Engine imports.
TE_MOE_FUNCTIONS = (
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)
# Hugging Face config values this worker builds (a key's absence means this value).
FIXED_HF_CONFIG: dict[str, Any] = {
    "hidden_act": "silu",
    "mlp_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
}
VOCAB_PADDED_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
# Megatron-LM's router arguments beyond the score function, with their defaults.
ROUTER_ARGS = {
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
}
# MLATransformerConfig's fields, by their Megatron-LM argument names.
MLA_ARGS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
)
# The local MLA layer's torch_dist names that the Transformer Engine spec's MLA layer gives otherwise.
TE_MLA_NAMES = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


@dataclass(frozen=True)
class ModelSpec:
    """The GPTModel architecture, shared by both subcommands."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    padded_vocab_size: int
    max_position_embeddings: int
    rotary_base: int | float
    norm_epsilon: float
    qkv_bias: bool
    tied: bool
    params_dtype: torch.dtype = torch.float32
    qk_layernorm: bool = False
    rotary_percent: float = 1.0
    moe: dict[str, Any] | None = None
    """TransformerConfig's mixture-of-experts fields (num_moe_experts, moe_*), None when dense."""
    mla: dict[str, Any] | None = None
    """MLATransformerConfig's fields (q_lora_rank, ..., rope_type and YaRN's), None without MLA."""
    te_names: bool = False
    """Store the tensors under the Transformer Engine spec's torch_dist names (``use_te_names``)."""


def install_cpu_shims() -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    for name in TE_MOE_FUNCTIONS:
        setattr(moe_utils, name, getattr(moe_utils, name, None))
    multi_latent_attention.HAVE_TE = False


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron-LM's _vocab_size_with_padding."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def spec_from_hf_config(config: dict[str, Any], tp: int) -> ModelSpec:
    if config["model_type"] not in ("llama", "qwen2"):
        raise SystemExit(f"model_type {config['model_type']!r}: only llama and qwen2 are built")
    rope = config.get("rope_parameters") or {}
    unsupported = {key: config[key] for key, value in FIXED_HF_CONFIG.items() if config.get(key, value) != value}
    if rope.get("rope_type", "default") != "default":
        unsupported["rope_parameters"] = rope
    if unsupported:
        raise SystemExit(f"config values this worker does not build: {unsupported}")
    heads = config["num_attention_heads"]
    theta = config.get("rope_theta", rope.get("rope_theta", 10000))
    return ModelSpec(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        padded_vocab_size=padded_vocab_size(config["vocab_size"], tp),
        max_position_embeddings=config["max_position_embeddings"],
        # Megatron-LM's --rotary-base is an int
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        norm_epsilon=config["rms_norm_eps"],
        qkv_bias=config["model_type"] == "qwen2" or config.get("attention_bias", False),
        tied=config.get("tie_word_embeddings", False),
    )


def moe_from_megatron_args(args: Namespace) -> dict[str, Any] | None:
    """TransformerConfig's MoE fields from Megatron-LM's arguments (None for a dense model)."""
    if not getattr(args, "num_experts", None):
        return None
    return {
        "num_moe_experts": args.num_experts,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size or args.ffn_hidden_size,
        "moe_router_topk": args.moe_router_topk,
        "moe_shared_expert_intermediate_size": args.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": args.moe_shared_expert_gate,
        "moe_layer_freq": args.moe_layer_freq,
        "moe_router_pre_softmax": args.moe_router_pre_softmax,
        "moe_router_score_function": args.moe_router_score_function,
        "moe_router_dtype": args.moe_router_dtype,
        **{name: getattr(args, name, default) for name, default in ROUTER_ARGS.items()},
        # SequentialMLP (GroupedMLP needs grouped_gemm, TEGroupedMLP Transformer Engine): the same torch_dist keys
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "moe_aux_loss_coeff": 0.0,
    }


def spec_from_megatron_args(args: Namespace, vocab_size: int | None) -> ModelSpec:
    unsupported = {key: getattr(args, key) for key, value in FIXED_ARGS.items() if getattr(args, key, value) != value}
    if unsupported:
        raise SystemExit(f"checkpoint args this worker does not build: {unsupported}")
    vocab_size = getattr(args, "vocab_size", None) or vocab_size
    if vocab_size is None:
        raise SystemExit("the checkpoint's args have no vocab_size: pass --vocab-size")
    heads = args.num_attention_heads
    return ModelSpec(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or args.hidden_size // heads,
        vocab_size=vocab_size,
        padded_vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        rotary_base=getattr(args, "rotary_base", 10000),
        norm_epsilon=args.layernorm_epsilon,
        qkv_bias=getattr(args, "add_qkv_bias", False),
        tied=not args.untie_embeddings_and_output_weights,
        params_dtype=args.params_dtype,
        qk_layernorm=getattr(args, "qk_layernorm", False),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        moe=moe_from_megatron_args(args),
        mla={name: getattr(args, name) for name in MLA_ARGS}
        if getattr(args, "multi_latent_attention", False)
        else None,
        te_names=getattr(args, "transformer_impl", "local") == "transformer_engine",
    )


def megatron_args(spec: ModelSpec, tp: int, pp: int, iteration: int) -> Namespace:
    """The checkpoint's ``args``: the Megatron-LM arguments of a run that trains this model."""
    return Namespace(
        **FIXED_ARGS,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        max_position_embeddings=spec.max_position_embeddings,
        seq_length=spec.max_position_embeddings,
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
        layernorm_epsilon=spec.norm_epsilon,
        add_qkv_bias=spec.qkv_bias,
        untie_embeddings_and_output_weights=not spec.tied,
        vocab_size=spec.vocab_size,
        padded_vocab_size=spec.padded_vocab_size,
        make_vocab_size_divisible_by=MAKE_VOCAB_SIZE_DIVISIBLE_BY,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        data_parallel_size=1,
        world_size=tp * pp,
        params_dtype=spec.params_dtype,
        bf16=spec.params_dtype == torch.bfloat16,
        fp16=spec.params_dtype == torch.float16,
        transformer_impl="local",
        ckpt_format="torch_dist",
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def init_parallel(tp: int, pp: int, ep: int = 1) -> None:
    dist.init_process_group("gloo")
    if dist.get_world_size() != tp * pp * ep:
        raise SystemExit(f"launch tp * pp * ep = {tp * pp * ep} processes, not {dist.get_world_size()}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    # The default CudaRNGStatesTracker needs torch.cuda.get_rng_state(); the inference tracker's
    # add/fork are no-ops, and attention still finds a tracker to fork. The seed only drives
    # megatron's own initialisation, which make overwrites and load replaces.
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


class MLACoreAttention(DotProductAttention):
    """megatron-core's local core attention, taking the head widths ``MLASelfAttention`` passes
    (the computation reads them from q, k and v; the output is laid out by ``kv_channels``).
    The base ``Attention`` builds one without them first, which MLA then replaces."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels not in (None, self.hidden_size_per_attention_head):
            raise SystemExit(f"args.kv_channels={self.hidden_size_per_attention_head} is not v_head_dim={v_channels}")


def use_te_names(layer: ModuleSpec, mla: bool) -> None:
    """Make a local layer spec store its tensors under the Transformer Engine spec's torch_dist
    names: a MoE layer keeps its own ``pre_mlp_layernorm`` (which the local spec renames), an
    MLA layer's latent norms are the up projections' fused norms and a dense MLA layer's
    post-attention norm is ``linear_fc1``'s."""
    moe = layer.submodules.mlp.module is MoELayer
    keys = {
        k: v for k, v in layer.submodules.sharded_state_dict_keys_map.items() if not (moe and k == "pre_mlp_layernorm.")
    }
    if mla:
        keys |= TE_MLA_NAMES | ({} if moe else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})
    layer.submodules.sharded_state_dict_keys_map = keys


def build_model(spec: ModelSpec) -> GPTModel:
    config = (MLATransformerConfig if spec.mla else TransformerConfig)(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=spec.params_dtype,
        pipeline_dtype=spec.params_dtype,
        bf16=spec.params_dtype == torch.bfloat16,
        fp16=spec.params_dtype == torch.float16,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        qk_layernorm=spec.qk_layernorm,
        expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(),
        **(spec.moe or {}),
        **({**spec.mla, "rotary_base": spec.rotary_base} if spec.mla else {}),  # MLA's rotary is its own
    )
    if spec.moe is None:
        layer_spec = get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=spec.qk_layernorm, multi_latent_attention=spec.mla is not None
        )
        layers = [layer_spec]
    else:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        layers = layer_spec.layer_specs
    for layer in layers:
        if spec.te_names:
            use_te_names(layer, spec.mla is not None)
        if spec.mla is not None:
            layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tied,
        position_embedding_type="rope",
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
    )
    return model.eval()


def sharded_metadata() -> dict[str, Any]:
    return {**CONTENT_METADATA, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}


def global_tensor(key: str, shape: tuple[int, ...], spec: ModelSpec, seed: int) -> torch.Tensor:
    """The whole tensor behind a sharded key, the same for every tp/pp: norm weights near 1,
    biases N(0, 0.1²), matrices N(0, 1/fan_in) so that activations and logits stay O(1)."""
    generator = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
    if key in VOCAB_PADDED_KEYS:
        rows = torch.randn(spec.vocab_size, shape[1], generator=generator) * shape[1] ** -0.5
        return torch.cat([rows, rows.new_zeros(shape[0] - spec.vocab_size, shape[1])])
    values = torch.randn(shape, generator=generator)
    if "layernorm" in key or "layer_norm" in key:
        return 1 + 0.1 * values
    if key.endswith(".bias"):
        return 0.1 * values
    return values * shape[-1] ** -0.5


@torch.no_grad()
def fill_weights(model: GPTModel, spec: ModelSpec, seed: int) -> None:
    """Copy each rank's slice of every global tensor into the model. The sharded tensors' data are
    the parameters or views of them (SwiGLU's fc1 halves; the last stage's copy of a tied
    embedding, sharded under the embedding's key)."""
    sharded_state_dict = model.sharded_state_dict(metadata=sharded_metadata())
    apply_factories(sharded_state_dict)
    for sharded in nested_values(sharded_state_dict):
        if not isinstance(sharded, ShardedTensor):
            continue  # _extra_state objects
        # layer-stacked keys prepend the layer axis to the local tensor
        local_shape = (1,) * sharded.prepend_axis_num + tuple(sharded.local_shape)
        full = global_tensor(sharded.key, tuple(sharded.global_shape), spec, seed)
        piece = full[tuple(slice(o, o + n) for o, n in zip(sharded.global_offset, local_shape, strict=True))]
        sharded.data.copy_(piece.reshape(sharded.local_shape))


def write_tracker(root: Path, iteration: int) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        (root / TRACKER).write_text(str(iteration))


def save_torch_dist(model: GPTModel, args: Namespace, root: Path, iteration: int) -> None:
    """Megatron-LM's save_checkpoint for --ckpt-format torch_dist --no-save-optim --no-save-rng."""
    checkpoint_dir = root / f"iter_{iteration:07d}"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    state_dict = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.sharded_state_dict(metadata=sharded_metadata()),
        "num_floating_point_operations_so_far": 0,
    }
    strategy = FullyParallelSaveStrategyWrapper(  # Megatron-LM's default --ckpt-fully-parallel-save
        get_default_save_sharded_strategy("torch_dist"), mpu.get_data_parallel_group(with_context_parallel=True)
    )
    dist_checkpointing.save(state_dict, str(checkpoint_dir), strategy, content_metadata=dict(CONTENT_METADATA))
    write_tracker(root, iteration)


def save_legacy(model: GPTModel, args: Namespace, root: Path, iteration: int) -> None:
    """Megatron-LM's save_checkpoint for --ckpt-format torch --no-save-optim --no-save-rng: the
    ranks of the first expert-data-parallel replica save, each in mp_rank_TT[_PPP][_EEE]."""
    if mpu.get_expert_data_parallel_rank() != 0:
        write_tracker(root, iteration)
        return
    rank_dir = f"mp_rank_{mpu.get_tensor_model_parallel_rank():02d}"
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        rank_dir += f"_{mpu.get_pipeline_model_parallel_rank():03d}"
    if mpu.get_expert_model_parallel_world_size() > 1:
        rank_dir += f"_{mpu.get_expert_model_parallel_rank():03d}"
    path = root / f"iter_{iteration:07d}" / rank_dir / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state_dict = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.state_dict_for_save_checkpoint(),
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state_dict, path)
    write_tracker(root, iteration)


def checkpoint_dir(root: Path) -> Path:
    marker = (root / TRACKER).read_text().strip()
    return root / ("release" if marker == "release" else f"iter_{int(marker):07d}")


def input_ids(path: Path | None, vocab_size: int) -> torch.Tensor:
    if path is not None:
        return torch.load(path, weights_only=True)
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def forward(model: GPTModel, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [B, S, padded vocab] on the last pipeline stage, None on the others. Stages pass the
    hidden state [S, B, H] on with plain send/recv instead of megatron's CUDA pipeline schedules."""
    batch, seq = ids.shape
    stage, stages = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    stage_ranks = dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())
    if stage > 0:
        hidden = torch.empty(seq, batch, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden, src=stage_ranks[stage - 1])
        model.set_input_tensor(hidden)
    # True = masked; without a mask megatron builds its default causal mask on "cuda"
    causal_mask = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)[None, None]
    positions = torch.arange(seq).expand(batch, seq)
    output = model(input_ids=ids, position_ids=positions, attention_mask=causal_mask)
    if stage < stages - 1:
        dist.send(output.contiguous(), dst=stage_ranks[stage + 1])
        return None
    shards = [torch.empty_like(output) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, output.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def write_logits(model: GPTModel, spec: ModelSpec, ids: torch.Tensor, out: Path) -> None:
    """out/logits.pt from the first rank of the last stage, the real vocab columns only."""
    logits = forward(model, ids)
    if logits is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids, "logits": logits[..., : spec.vocab_size].float()}, out / "logits.pt")
    dist.barrier()


def make(cli: Namespace) -> None:
    spec = spec_from_hf_config(json.loads(cli.config.read_text()), cli.tp)
    model = build_model(spec)
    fill_weights(model, spec, cli.seed)
    args = megatron_args(spec, cli.tp, cli.pp, cli.iteration)
    save_torch_dist(model, args, cli.out / "torch_dist", cli.iteration)
    if cli.legacy:
        save_legacy(model, args, cli.out / "legacy", cli.iteration)
    write_logits(model, spec, input_ids(cli.ids, spec.vocab_size), cli.out)


def load(cli: Namespace) -> None:
    directory = checkpoint_dir(cli.load)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    spec = spec_from_megatron_args(common["args"], cli.vocab_size)
    model = build_model(spec)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=sharded_metadata())}, str(directory))
    # load returns tensors (fc1 merged anew from its SwiGLU halves), not always the parameters themselves
    model.load_state_dict(loaded["model"])
    write_logits(model, spec, input_ids(cli.ids, spec.vocab_size), cli.out)
    if cli.resave:
        save_torch_dist(model, common["args"], cli.out / "torch_dist", common["iteration"])
    if cli.legacy:
        save_legacy(model, common["args"], cli.out / "legacy", common["iteration"])


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Callable[[Namespace], None], summary: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary)
        sub.set_defaults(run=run)
        sub.add_argument("--tp", type=int, required=True)
        sub.add_argument("--pp", type=int, required=True)
        sub.add_argument("--out", type=Path, required=True, help="root of everything written")
        sub.add_argument("--ids", type=Path, help="torch.save'd LongTensor [B, S] to run the forward on")
        return sub

    make_parser = command("make", make, "build, fill and save a model from a Hugging Face config.json")
    make_parser.add_argument("--config", type=Path, required=True, help="Llama or Qwen2 config.json")
    make_parser.add_argument("--iteration", type=int, required=True)
    make_parser.add_argument("--legacy", action="store_true", help="also save the --ckpt-format torch layout")
    make_parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    load_parser = command("load", load, "load a torch_dist checkpoint at --tp/--pp")
    load_parser.add_argument("--load", type=Path, required=True, help="root holding " + TRACKER)
    load_parser.add_argument("--vocab-size", type=int, help="true vocab size when the args have none")
    load_parser.add_argument("--resave", action="store_true", help="save the loaded model into OUT/torch_dist")
    load_parser.add_argument("--legacy", action="store_true", help="save the loaded model into OUT/legacy")
    load_parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture of experts)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    cli = parse_args(argv)
    install_cpu_shims()
    init_parallel(cli.tp, cli.pp, getattr(cli, "ep", 1))  # only "load" takes --ep
    try:
        cli.run(cli)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
