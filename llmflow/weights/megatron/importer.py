"""A megatron-core GPTModel checkpoint read as llmflow's model state: which Megatron tensor
(and layer) each of the decoder's tensors comes from, checked against the model's Hugging Face
config before anything is written.

Supported: the Llama/Qwen2/Qwen3 families as Megatron-LM and MindSpeed-LLM train them — RMSNorm,
SwiGLU, rotary positions (not interleaved; over part of each head with ``rotary_percent``), no
linear biases except optional q/k/v biases, optional per-head q/k RMSNorms (``qk_layernorm``),
tied or untied output layer, grouped-query attention — and their mixtures of experts
(Qwen3-MoE, Qwen2-MoE, Mixtral): a softmax top-k router, SwiGLU experts, an optional shared
expert with its sigmoid gate, dense layers among the MoE layers; DeepSeek-V3's Multi-head
Latent Attention (``multi_latent_attention``, plain or YaRN rotary) and its sigmoid router
(correction bias, expert groups, scaled weights, ungated shared experts), GLM-4.5's too.
Optimizer and RNG state are not read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmflow.models.blocks.rotary import yarn_mscale
from llmflow.models.config import ModelConfig
from llmflow.weights.errors import CheckpointError
from llmflow.weights.megatron.layout import (
    EMBEDDING,
    FINAL_NORM,
    OTHER_SOURCES,
    OUTPUT,
    ROUTER,
    Attention,
    layer_key,
    layer_shapes,
    layer_sources,
    layer_tensors,
    missing_biases,
    mla_args,
    moe_pattern,
    other_tensors,
    router_args,
    unfuse,
    unmapped_layers,
)
from llmflow.weights.megatron.reader import MegatronCheckpoint

# Megatron-LM argument -> (what llmflow supports, why it matters), checked when args are present.
_REQUIRED_ARGS: dict[str, tuple[Any, str]] = {
    "swiglu": (True, "a SwiGLU feed-forward"),
    "normalization": ("RMSNorm", "RMSNorm"),
    "position_embedding_type": ("rope", "rotary position embeddings"),
    "add_bias_linear": (False, "no biases on the linear layers (q/k/v biases aside)"),
    "apply_layernorm_1p": (False, "plain norm weights (not stored as weight - 1)"),
    "rotary_interleaved": (False, "rotary embeddings on halves, as Hugging Face applies them"),
}
# Settings of a MoE checkpoint llmflow computes one way only, checked when args have them:
# (the values that mean so, what llmflow computes).
_FIXED_MOE_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "moe_expert_capacity_factor": ((None,), "dropless routing (no expert capacity)"),
    "moe_latent_size": ((None,), "experts on the hidden state itself"),
}
_YARN_ARGS = (
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
)
"""MLA's rotary arguments compared for YaRN only (for plain rotary, only whether
``rotary_scaling_factor`` and ``mscale_all_dim`` scale the softmax)."""


@dataclass(frozen=True)
class Planned:
    """One tensor of llmflow's model state and how it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


def _moe_args(args: Any, config: ModelConfig, source: str) -> list[str]:
    """What the args of a checkpoint say of experts that is not the model of ``config``."""
    found = []
    experts = getattr(args, "num_experts", None) or 0
    if experts != config.num_experts:
        found.append(
            f"args.num_experts={experts or None} where {source} has "
            + (f"num_experts={config.num_experts}" if config.num_experts else "a dense model")
        )
    if not experts or not config.num_experts:
        return found
    shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
    ffn = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None)
    expected = {
        "moe_router_topk": (getattr(args, "moe_router_topk", None), config.num_experts_per_tok),
        "moe_ffn_hidden_size": (ffn, config.moe_intermediate_size),
        "moe_shared_expert_intermediate_size": (shared, config.shared_expert_intermediate_size),
    }
    for name, (value, wanted) in expected.items():
        if value is not None and value != wanted:
            found.append(f"args.{name}={value} where {source} has {wanted}")
    if shared and bool(getattr(args, "moe_shared_expert_gate", False)) != config.shared_expert_gated:
        found.append(
            "args.moe_shared_expert_gate is "
            + (
                "not set (llmflow's shared expert is scaled by its sigmoid gate)"
                if config.shared_expert_gated
                else "set (llmflow's shared experts are ungated)"
            )
        )
    found += _router_args(args, config, source)
    for name, (accepted, meaning) in _FIXED_MOE_ARGS.items():
        value = getattr(args, name, None)
        if value not in accepted:
            found.append(f"args.{name}={value!r} (llmflow computes {meaning}: {name}={accepted[0]!r})")
    freq = getattr(args, "moe_layer_freq", None)
    if freq is not None:
        pattern = moe_pattern(freq, config.num_hidden_layers)
        wanted = [int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)]
        if pattern != wanted:
            found.append(
                f"args.moe_layer_freq={freq!r} (MoE layers {pattern}) where {source} has MoE layers "
                f"{wanted} (mlp_only_layers/decoder_sparse_step)"
            )
    return found


def _router_settings(values: dict[str, Any]) -> dict[str, Any]:
    """What megatron-core's TopKRouter computes by router arguments (absent ones at its
    defaults): the score function, softmax before the top k (the softmax router only), the
    scaling of the weights (none for 0, None or 1), the groups (none without group_topk or
    when every group is kept) and whether the expert bias is added."""
    score = values.get("moe_router_score_function") or "softmax"
    scaling = values.get("moe_router_topk_scaling_factor")
    groups, kept = values.get("moe_router_num_groups"), values.get("moe_router_group_topk")
    limited = bool(kept) and kept != groups
    return {
        "moe_router_score_function": score,
        "moe_router_pre_softmax": bool(values.get("moe_router_pre_softmax")) if score == "softmax" else None,
        "moe_router_topk_scaling_factor": float(scaling) if scaling not in (None, 0, 1) else None,
        "moe_router_num_groups": groups if limited else None,
        "moe_router_group_topk": kept if limited else None,
        "moe_router_enable_expert_bias": bool(values.get("moe_router_enable_expert_bias")),
    }


def _router_args(args: Any, config: ModelConfig, source: str) -> list[str]:
    """The router arguments of a checkpoint that route otherwise than llmflow's router of
    ``config`` (``router_args``), each with the value that routes as it does."""
    wanted = router_args(config)
    have = _router_settings({name: getattr(args, name, None) for name in wanted})
    expected = _router_settings(wanted)
    score = "moe_router_score_function"
    differ = [score] if have[score] != expected[score] else [name for name in expected if have[name] != expected[name]]
    return [
        f"args.{name}={getattr(args, name, None)!r} where {source} routes with {name}={wanted[name]!r} "
        f"({config.router_scoring} router, norm_topk_prob={config.norm_topk_prob})"
        for name in differ
    ]


def _mla_args(args: Any, config: ModelConfig, source: str) -> list[str]:
    """What the args of a checkpoint say of Multi-head Latent Attention that is not the
    attention of ``config`` (``mla_args``; absent values are not compared)."""
    latent = bool(getattr(args, "multi_latent_attention", False))
    if latent != bool(config.kv_lora_rank):
        return [
            f"args.multi_latent_attention={latent} where {source} has "
            + (f"kv_lora_rank={config.kv_lora_rank}" if config.kv_lora_rank else "no Multi-head Latent Attention")
        ]
    if not latent:
        return []
    wanted = mla_args(config)
    yarn = wanted["rope_type"] == "yarn"
    found = [
        f"args.{name}={getattr(args, name)!r} where {source} implies {value!r}"
        for name, value in wanted.items()
        if (yarn or name not in _YARN_ARGS) and getattr(args, name, None) is not None and getattr(args, name) != value
    ]
    factor, all_dims = getattr(args, "rotary_scaling_factor", None), getattr(args, "mscale_all_dim", None)
    if not yarn and factor is not None and all_dims is not None and yarn_mscale(factor, all_dims) != 1.0:
        found.append(
            f"args.rotary_scaling_factor={factor} with args.mscale_all_dim={all_dims} scale MLA's softmax "
            f"by {yarn_mscale(factor, all_dims) ** 2:.6g} where {source} has plain rotary"
        )
    return found


def check_supported(checkpoint: MegatronCheckpoint, config: ModelConfig, source: str) -> None:
    """Raise, naming what the checkpoint has and what was expected, when it is not a model
    llmflow can hold or not the model ``config`` describes."""
    if reason := unmapped_layers(config):
        raise CheckpointError(f"--megatron {checkpoint.directory}: {reason}")
    args = checkpoint.args
    found = []
    if args is not None:
        for name, (wanted, meaning) in _REQUIRED_ARGS.items():
            value = getattr(args, name, wanted)
            if value != wanted and not (name == "rotary_interleaved" and value is None):
                found.append(f"args.{name}={value!r} (llmflow reads {meaning}: {name}={wanted!r})")
        found += _moe_args(args, config, source) + _mla_args(args, config, source)
        groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
        dense = any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        latent = bool(config.kv_lora_rank)
        expected = {
            "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "ffn_hidden_size": config.intermediate_size if dense else None,
            "num_attention_heads": config.num_attention_heads,
            "num_query_groups": config.num_key_value_heads if groups is not None else None,
            "kv_channels": None if latent else config.head_dim,  # MLA's head widths are its own arguments
            "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
            "add_qkv_bias": config.qkv_bias and not latent,
            "qk_layernorm": config.qk_norm or latent,
            "rotary_percent": config.partial_rotary_factor,
            "rotary_base": config.rope_theta,
        }
        actual = {**{name: getattr(args, name, None) for name in expected}, "num_query_groups": groups}
        for name, value in expected.items():
            if actual[name] is not None and value is not None and actual[name] != value:
                found.append(f"args.{name}={actual[name]} where {source} has {value}")
    if biases := missing_biases(config):
        found.append(f"{source} has {biases}, which Megatron's layout (q/k/v biases only) cannot hold")
    if not found:
        found += _layer_kinds(checkpoint, config, source)
    missing = [key for key in expected_keys(config) if key not in checkpoint.shapes]
    if missing and not found:
        found.append(f"no tensors {missing[:4]} (it holds {sorted(checkpoint.shapes)[:8]})")
    if found:
        raise CheckpointError(
            f"--megatron {checkpoint.directory} ({checkpoint.format}): not the model of {source}: " + "; ".join(found)
        )
    hidden, per_layer = config.hidden_size, layer_shapes(config)
    shapes = {
        layer_key(name, i): per_layer[name]
        for i in range(config.num_hidden_layers)
        for name in layer_tensors(config, i)
    } | {FINAL_NORM: (hidden,)}
    for key, shape in shapes.items():
        if checkpoint.shapes[key] != shape:
            what = (
                f"holds {checkpoint.shapes[key][0]} experts where {source} has num_experts={config.num_experts}"
                if key.endswith(ROUTER) and checkpoint.shapes[key][1:] == shape[1:]
                else f"has shape {checkpoint.shapes[key]}, {source} implies {shape}"
            )
            raise CheckpointError(f"--megatron {checkpoint.directory}: {key} {what}")
    for key in (EMBEDDING, OUTPUT):
        if key in checkpoint.shapes and (
            checkpoint.shapes[key][0] < config.vocab_size or checkpoint.shapes[key][1:] != (hidden,)
        ):
            raise CheckpointError(
                f"--megatron {checkpoint.directory}: {key} has shape {checkpoint.shapes[key]}, "
                f"{source} implies ({config.vocab_size} or more rows, {hidden})"
            )


def _layer_kinds(checkpoint: MegatronCheckpoint, config: ModelConfig, source: str) -> list[str]:
    """The layers the checkpoint routes (it has a router) where ``config`` has them dense, or
    the other way round."""
    routed = [i for i in range(config.num_hidden_layers) if layer_key(ROUTER, i) in checkpoint.shapes]
    wanted = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    if routed == wanted:
        return []
    return [
        f"MoE layers {routed} (those with {ROUTER}) where {source} has "
        + (f"MoE layers {wanted}" if config.num_experts else "a dense model")
    ]


def expected_keys(config: ModelConfig) -> list[str]:
    """The Megatron tensors (canonical keys) a model of ``config`` is read from."""
    return other_tensors(config) + [
        layer_key(name, i) for i in range(config.num_hidden_layers) for name in layer_tensors(config, i)
    ]


def plan_import(checkpoint: MegatronCheckpoint, config: ModelConfig, padded: int) -> dict[str, Planned]:
    """llmflow's model state (``CausalLM.state_dict()`` names of the model padded to ``padded``
    rows), each tensor read on demand from the checkpoint. Megatron's padding rows are dropped
    and llmflow's are zeros."""
    attention = Attention.of(config)
    vocab, hidden = config.vocab_size, config.hidden_size

    def vocabulary(key: str) -> Planned:
        def read() -> torch.Tensor:
            out = torch.zeros(padded, hidden, dtype=checkpoint.dtypes[key])
            checkpoint.read_rows(key, out[:vocab])
            return out

        return Planned((padded, hidden), checkpoint.dtypes[key], read)

    def whole(key: str, select: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Planned:
        sample = select(torch.empty(checkpoint.shapes[key], device="meta"))
        return Planned(
            tuple(sample.shape), checkpoint.dtypes[key], lambda: select(checkpoint.read(key)).contiguous().clone()
        )

    plan = {
        OTHER_SOURCES[EMBEDDING]: vocabulary(EMBEDDING),
        OTHER_SOURCES[FINAL_NORM]: whole(FINAL_NORM),
        OTHER_SOURCES[OUTPUT]: vocabulary(EMBEDDING if config.tie_word_embeddings else OUTPUT),
    }
    for i in range(config.num_hidden_layers):
        for name, parts in layer_sources(config, i).items():
            for j, part in enumerate(parts):
                plan[f"model.layers.{i}.{part}"] = whole(
                    layer_key(name, i), lambda t, name=name, j=j: unfuse(name, t, attention)[j]
                )
    return plan
