"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (bias on q/k/v) and a
mixture of experts with a shared expert: every token also goes through ``shared_expert``,
scaled by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.moe_options import read_experts, write_experts
from llmflow.models.families.qwen2 import read_sliding_window


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("qkv_bias", True))
    if hf.get("use_sliding_window", False) and not hf.get("layer_types"):
        # Qwen2MoeConfig's own default: a window on the odd-numbered layers below max_window_layers.
        first_full = hf.get("max_window_layers", 28)
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % 2 and i < first_full else "full_attention"
                                    for i in range(hf["num_hidden_layers"])]}
    return {"qkv_bias": bias, "o_bias": False, "mlp_bias": False, "sliding_window": read_sliding_window(hf, source),
            "moe_intermediate_size": hf.get("moe_intermediate_size", 1408),
            "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 5632),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            **read_experts(hf, source, ("num_experts", "num_local_experts"))}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {"qkv_bias": config.qkv_bias, "moe_intermediate_size": config.moe_intermediate_size,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob, **write_experts("num_experts", config)}


QWEN2_MOE = Family("qwen2_moe", read_options, llama.build_layer, "Qwen2MoeForCausalLM", write_options)
