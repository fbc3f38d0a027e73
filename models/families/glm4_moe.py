"""GLM-4.5 and GLM-4.6 (GLM-4.5-Air too): Llama's layers with rotary over the first
``partial_rotary_factor`` (0.5) of each head, biases on q/k/v when ``attention_bias`` (never on
o), per-head q/k RMSNorms when ``use_qk_norm``, and DeepSeek-V3's mixture of experts: the
sigmoid router with ``e_score_correction_bias`` and groups, ungated ``shared_experts``, and
dense first layers (``first_k_dense_replace``).

The Hub's checkpoints hold the multi-token prediction layer as the layer after the last one
(``model.layers.{num_hidden_layers}``), which is left out, as transformers leaves it out."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import Family, ModelConfig
from llmflow.models.families import llama
from llmflow.models.families.moe_options import read_sigmoid_routing, write_sigmoid_routing

ROUTING_DEFAULTS = {"n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "moe_intermediate_size": 1408, "norm_topk_prob": True}
"""Glm4MoeConfig's defaults for the routing keys."""
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5
DEFAULT_RMS_NORM_EPS = 1e-5
MTP = "the multi-token prediction layer"


def read_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    return {"qkv_bias": bool(hf.get("attention_bias", False)), "o_bias": False, "mlp_bias": False,
            "qk_norm": bool(hf.get("use_qk_norm", False)), "partial_rotary_factor": float(partial),
            "rms_norm_eps": hf.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS),
            **read_sigmoid_routing(hf, source, ROUTING_DEFAULTS)}


def write_options(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "use_qk_norm": config.qk_norm, **write_sigmoid_routing(config)}


GLM4_MOE = Family("glm4_moe", read_options, llama.build_layer, "Glm4MoeForCausalLM", write_options,
                  hf_extra_layers=MTP)
