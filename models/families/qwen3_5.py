"""Qwen3.5, dense (Qwen3.5-27B, ...) and mixture of experts (Qwen3.5-35B-A3B, ...): Qwen3-Next's
hybrid layers (``qwen3_next.py``) with the Gated DeltaNet's projections apart
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); the MoE variant routes every
layer (top-k weights always renormalised) and adds a shared expert.

The published models are multimodal (``qwen3_5``/``qwen3_5_moe``, ``*ForConditionalGeneration``):
config.json nests the decoder's keys in ``text_config``, the checkpoint names the decoder
``model.language_model.*`` beside the vision tower ``model.visual.*`` (left out: llmflow
builds the text model) and multi-token prediction layers ``mtp.*`` (left out too). The
text-only models (``qwen3_5_text``/``qwen3_5_moe_text``, ``*ForCausalLM``) name the decoder
``model.*``. Experts are written one tensor per expert (``mlp.experts.{i}.gate_proj.weight``),
as transformers 5's ``save_pretrained`` writes both MoE variants, and read either so or fused
per layer as the published Qwen3.5-MoE checkpoints store them (``mlp.experts.gate_up_proj``
[E, 2 I, H], ``mlp.experts.down_proj`` [E, H, I]), which transformers reads too
(``llmflow.weights.hf_names``).

Rotary: the text model's multimodal sections (``mrope_section``, interleaved) take the
temporal, height and width positions of each token; a text token's three positions are
equal, so every section rotates by the same position and the rotary is the ordinary one,
over the first ``partial_rotary_factor`` of each head.
"""

from __future__ import annotations

from typing import Any

from llmflow.models.config import Family, ModelConfig
from llmflow.models.families.qwen3_next import (
    MTP,
    build_hybrid_layer,
    read_hybrid,
    read_moe,
    write_hybrid,
    write_moe,
)

LANGUAGE_MODEL = (("model.", "model.language_model."),)
VISION = ("model.visual.", "the vision tower")


def read_dense(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**read_hybrid(hf, source), "num_experts": 0}


def read_moe_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**read_hybrid(hf, source), **read_moe(hf, source, every_layer=True, norm_topk_prob=True)}


def write_moe_options(config: ModelConfig) -> dict[str, Any]:
    return {**write_hybrid(config), **write_moe(config, norm_topk_prob=False)}


def build_layer(config: ModelConfig, index: int):
    return build_hybrid_layer(config, index, fused_projections=False)


QWEN3_5_TEXT = Family("qwen3_5_text", read_dense, build_layer, "Qwen3_5ForCausalLM", write_hybrid,
                      hf_left_out=(VISION, MTP))
QWEN3_5 = Family("qwen3_5", read_dense, build_layer, "Qwen3_5ForConditionalGeneration", write_hybrid,
                 hf_renames=LANGUAGE_MODEL, text_config_key="text_config", hf_left_out=(VISION, MTP))
QWEN3_5_MOE_TEXT = Family("qwen3_5_moe_text", read_moe_options, build_layer, "Qwen3_5MoeForCausalLM",
                          write_moe_options, hf_left_out=(VISION, MTP))
QWEN3_5_MOE = Family("qwen3_5_moe", read_moe_options, build_layer, "Qwen3_5MoeForConditionalGeneration",
                     write_moe_options, hf_renames=LANGUAGE_MODEL, text_config_key="text_config",
                     hf_left_out=(VISION, MTP))
