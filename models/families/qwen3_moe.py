"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) and
a mixture of experts on every layer ``mlp_only_layers``/``decoder_sparse_step`` leave sparse:
softmax router, top-k experts, their weights renormalised when ``norm_topk_prob``."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.moe_options import read_experts, write_experts


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    # Qwen3MoeConfig: one window on every layer when use_sliding_window (no layer_types).
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True, "sliding_window": window,
            "moe_intermediate_size": hf.get("moe_intermediate_size", 768),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            **read_experts(hf, source, ("num_experts", "num_local_experts"))}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "moe_intermediate_size": config.moe_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob, **write_experts("num_experts", config)}


QWEN3_MOE = Family("qwen3_moe", read_options, llama.build_layer, "Qwen3MoeForCausalLM", write_options)
