"""Parameter names between Hugging Face checkpoints and the decoder.

The decoder uses HF's module names, so most names map to themselves. What the map adds:
keys HF files may carry that are not parameters (rotary ``inv_freq`` buffers of older
exports), the output projection that tied checkpoints omit, the family's own spelling of a
module (``Family.hf_renames``: Mixtral's ``block_sparse_moe``), and the routed experts: the
decoder stacks each projection of a layer's experts into one tensor
(``mlp.experts.gate_proj`` [experts, out, in]) where the Hub stores one tensor per expert
(``mlp.experts.{i}.gate_proj.weight``), or every expert of a layer fused as transformers 5
holds them in memory and reads them too (``mlp.experts.gate_up_proj`` [experts, 2 inter,
hidden], gate rows first, and ``mlp.experts.down_proj`` [experts, hidden, inter]; the
published Qwen3.5-MoE checkpoints). Tensors that are no part of the decoder
(``Family.hf_left_out``: a vision tower, multi-token prediction layers) are left out, and
``left_out`` says which; convert and export carry them (``carried.py``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from llmflow.models.config import ModelConfig, family_of

# Buffers some HF exports contain; recomputed from the config instead.
_IGNORED_HF_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_STACKED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<projection>gate_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<fused>gate_up_proj|down_proj)$")
FUSED_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""transformers' fused expert tensors: our stacked projections each holds, in order along dim 1."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
TIED_OUTPUT = "lm_head.weight"
TIED_INPUT = "model.embed_tokens.weight"


def _renamed(name: str, config: ModelConfig, to_hf: bool) -> str:
    for ours, theirs in family_of(config.model_type).hf_renames:
        name = name.replace(ours, theirs) if to_hf else name.replace(theirs, ours)
    return name


def is_stacked_experts(name: str) -> bool:
    """Whether our parameter ``name`` holds every routed expert of a layer along dim 0."""
    return _STACKED.match(name) is not None


def hf_names(name: str, config: ModelConfig) -> list[str]:
    """The checkpoint tensors our parameter ``name`` is saved as: itself, or for stacked
    experts one tensor per expert, in expert order."""
    stacked = _STACKED.match(name)
    if stacked is None:
        return [_renamed(name, config, to_hf=True)]
    theirs = dict(family_of(config.model_type).hf_expert_projections)[stacked["projection"]]
    experts = _renamed(stacked["experts"], config, to_hf=True)
    return [f"{experts}.{i}.{theirs}.weight" for i in range(config.num_experts)]


def split_experts(name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Our parameter's value as the tensors ``hf_names`` names: one per expert of stacked
    experts (views), else itself."""
    return list(tensor.unbind(0)) if is_stacked_experts(name) else [tensor]


def hf_to_ours(hf_name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """(our parameter name, the expert's index in it or None) for an HF tensor name; None for
    tensors we do not load."""
    if _IGNORED_HF_KEYS.search(hf_name) or _left_out_part(hf_name, config) is not None:
        return None
    if config.tie_word_embeddings and hf_name == TIED_OUTPUT:
        return None
    per_expert = _PER_EXPERT.match(hf_name)
    if per_expert is not None and config.num_experts:
        ours = {theirs: ours for ours, theirs in family_of(config.model_type).hf_expert_projections}
        projection = ours.get(per_expert["projection"])
        if projection is not None:
            experts = _renamed(per_expert["experts"], config, to_hf=False)
            return f"{experts}.{projection}", int(per_expert["index"])
    return _renamed(hf_name, config, to_hf=False), None


def fused_experts(hf_name: str, config: ModelConfig) -> list[str] | None:
    """Our stacked expert projections the checkpoint tensor ``hf_name`` holds fused, in their
    order along its dim 1 (``...experts.gate_up_proj``: gate_proj then up_proj); None for any
    other tensor (and for every tensor of a model without experts or one the decoder leaves out)."""
    fused = _FUSED.match(hf_name) if family_of(config.model_type).hf_fused_experts else None
    if fused is None or not config.num_experts or hf_to_ours(hf_name, config) is None:
        return None
    experts = _renamed(fused["experts"], config, to_hf=False)
    return [f"{experts}.{projection}" for projection in FUSED_PROJECTIONS[fused["fused"]]]


def _left_out_part(hf_name: str, config: ModelConfig) -> tuple[str, str] | None:
    family = family_of(config.model_type)
    extra = _LAYER.match(hf_name) if family.hf_extra_layers is not None else None
    if extra is not None and int(extra[1]) >= config.num_hidden_layers:
        return extra[0], family.hf_extra_layers
    return next((part for part in family.hf_left_out if hf_name.startswith(part[0])), None)


def left_out(hf_names: list[str], config: ModelConfig) -> str | None:
    """One line naming the checkpoint tensors the decoder leaves out ("left out 123 tensors of
    the vision tower (model.visual.*)"), or None when it loads them all."""
    counts: dict[tuple[str, str], int] = {}
    for name in hf_names:
        part = _left_out_part(name, config)
        if part is not None:
            counts[part] = counts.get(part, 0) + 1
    if not counts:
        return None
    return "left out " + ", ".join(f"{n} tensors of {what} ({prefix}*)" for (prefix, what), n in counts.items())


def left_out_prefix(hf_name: str, config: ModelConfig) -> str | None:
    """The name prefix under which the decoder leaves the checkpoint tensor ``hf_name`` out
    (``model.visual.``), or None for a tensor it does not leave out."""
    part = _left_out_part(hf_name, config)
    return None if part is None else part[0]


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint stores of ``model``, by name: its parameters (a tied output projection
    once, as the embedding) and its persistent buffers (a router's ``e_score_correction_bias``),
    which keep the dtype the model gives them whatever the dtype of its weights."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                tensors[f"{prefix}.{name}" if prefix else name] = buffer
    return tensors


def expected_names(model: nn.Module) -> list[str]:
    """The names a checkpoint must provide for ``model`` (``checkpoint_tensors``)."""
    return list(checkpoint_tensors(model))
