"""A megatron-core GPTModel checkpoint read as llmflow's model state: which Megatron tensor
(and layer) each of the decoder's tensors comes from, checked against the model's Hugging Face
config before anything is written.

Supported: the Llama/Qwen2/Qwen3 families as Megatron-LM and MindSpeed-LLM train them — RMSNorm,
SwiGLU, rotary positions (not interleaved), no linear biases except optional q/k/v biases,
optional per-head q/k RMSNorms (``qk_layernorm``), tied or untied output layer, grouped-query
attention. Optimizer and RNG state are not read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmflow.models.config import ModelConfig
from llmflow.weights.errors import CheckpointError
from llmflow.weights.megatron.layout import (
    EMBEDDING,
    FINAL_NORM,
    LAYER_SOURCES,
    LAYERS,
    OTHER_SOURCES,
    OUTPUT,
    Attention,
    layer_shapes,
    layer_tensors,
    missing_biases,
    other_tensors,
    unfuse,
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


@dataclass(frozen=True)
class Planned:
    """One tensor of llmflow's model state and how it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


def check_supported(checkpoint: MegatronCheckpoint, config: ModelConfig, source: str) -> None:
    """Raise, naming what the checkpoint has and what was expected, when it is not a model
    llmflow can hold or not the model ``config`` describes."""
    args = checkpoint.args
    found = []
    if args is not None:
        for name, (wanted, meaning) in _REQUIRED_ARGS.items():
            value = getattr(args, name, wanted)
            if value != wanted and not (name == "rotary_interleaved" and value is None):
                found.append(f"args.{name}={value!r} (llmflow reads {meaning}: {name}={wanted!r})")
        if getattr(args, "num_experts", None):
            found.append(f"args.num_experts={args.num_experts} (mixture-of-experts models are not supported)")
        groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
        expected = {
            "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "ffn_hidden_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
            "num_query_groups": config.num_key_value_heads if groups is not None else None,
            "kv_channels": config.head_dim, "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
            "add_qkv_bias": config.qkv_bias, "qk_layernorm": config.qk_norm,
        }
        actual = {**{name: getattr(args, name, None) for name in expected}, "num_query_groups": groups}
        for name, value in expected.items():
            if actual[name] is not None and value is not None and actual[name] != value:
                found.append(f"args.{name}={actual[name]} where {source} has {value}")
    if biases := missing_biases(config):
        found.append(f"{source} has {biases}, which Megatron's layout (q/k/v biases only) cannot hold")
    missing = [key for key in expected_keys(config) if key not in checkpoint.shapes]
    if missing:
        found.append(f"no tensors {missing[:4]} (it holds {sorted(checkpoint.shapes)[:8]})")
    if found:
        raise CheckpointError(f"--megatron {checkpoint.directory} ({checkpoint.format}): not the model of {source}: "
                              + "; ".join(found))
    layers, hidden = config.num_hidden_layers, config.hidden_size
    shapes = {LAYERS + name: (layers, *shape) for name, shape in layer_shapes(config).items()} | {FINAL_NORM: (hidden,)}
    for key, shape in shapes.items():
        if key in checkpoint.shapes and checkpoint.shapes[key] != shape:
            raise CheckpointError(f"--megatron {checkpoint.directory}: {key} has shape {checkpoint.shapes[key]}, "
                                  f"{source} implies {shape}")
    for key in (EMBEDDING, OUTPUT):
        if key in checkpoint.shapes and (checkpoint.shapes[key][0] < config.vocab_size
                                         or checkpoint.shapes[key][1:] != (hidden,)):
            raise CheckpointError(f"--megatron {checkpoint.directory}: {key} has shape {checkpoint.shapes[key]}, "
                                  f"{source} implies ({config.vocab_size} or more rows, {hidden})")


def expected_keys(config: ModelConfig) -> list[str]:
    """The Megatron tensors a model of ``config`` is read from."""
    return other_tensors(config) + [LAYERS + name for name in layer_tensors(config)]


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

    def whole(key: str, layer: int | None, select: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Planned:
        shape = checkpoint.shapes[key][1:] if layer is not None else checkpoint.shapes[key]
        sample = select(torch.empty(shape, device="meta"))
        return Planned(tuple(sample.shape), checkpoint.dtypes[key],
                       lambda: select(checkpoint.read(key, layer)).contiguous().clone())

    plan = {OTHER_SOURCES[EMBEDDING]: vocabulary(EMBEDDING), OTHER_SOURCES[FINAL_NORM]: whole(FINAL_NORM, None),
            OTHER_SOURCES[OUTPUT]: vocabulary(EMBEDDING if config.tie_word_embeddings else OUTPUT)}
    for i in range(config.num_hidden_layers):
        for name in layer_tensors(config):
            for j, part in enumerate(LAYER_SOURCES[name]):
                plan[f"model.layers.{i}.{part}"] = whole(LAYERS + name, i,
                                                         lambda t, name=name, j=j: unfuse(name, t, attention)[j])
    return plan
