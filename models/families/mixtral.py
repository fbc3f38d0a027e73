"""Mixtral (8x7B, 8x22B): Mistral's attention and a mixture of experts on every layer, the
top-k routing weights always renormalised. The Hub's checkpoints name the block
``block_sparse_moe`` and each expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import ConfigError, Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.moe_options import read_experts, write_experts


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not supported; "
                          "llmflow routes without noise (0.0)")
    experts = read_experts(hf, source, ("num_local_experts",))
    return {"sliding_window": hf.get("sliding_window"), "moe_intermediate_size": hf["intermediate_size"],
            "norm_topk_prob": True, **experts, "dense_layers": ()}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {"intermediate_size": config.moe_intermediate_size, **write_experts("num_local_experts", config)}


MIXTRAL = Family("mixtral", read_options, llama.build_layer, "MixtralForCausalLM", write_options,
                 hf_renames=((".mlp.", ".block_sparse_moe."),),
                 hf_expert_projections=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")))
