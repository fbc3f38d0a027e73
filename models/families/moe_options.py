"""The config.json keys of a mixture-of-experts model that Qwen2-MoE, Qwen3-MoE and Mixtral
share (how many experts, how many per token, and which layers stay dense), those of
DeepSeek-V3's design that GLM-4.5 (and Kimi K2) share (sigmoid routing with a correction bias
and groups, ungated shared experts, dense first layers), and the router each layer gets."""

from __future__ import annotations

from typing import Any

from llmflow.models.blocks.moe import TopKRouter
from llmflow.models.blocks.moe_routing import GroupLimitedRouter
from llmflow.models.config import ConfigError, ModelConfig


def read_experts(hf: dict[str, Any], source: str, count_keys: tuple[str, ...]) -> dict[str, Any]:
    """``num_experts`` from the first of ``count_keys`` config.json has (transformers 5 saves
    Qwen3-MoE's as ``num_local_experts``), ``num_experts_per_tok``, and the dense layers of
    ``mlp_only_layers`` and ``decoder_sparse_step`` (a layer i routes when (i + 1) is a
    multiple of the step), as transformers builds its layers."""
    experts = next((hf[key] for key in count_keys if key in hf), None)
    if not isinstance(experts, int) or experts < 1:
        raise ConfigError(f"{source}: {count_keys[0]}={experts!r}; a mixture of experts needs a positive expert count")
    top_k = hf.get("num_experts_per_tok", 2)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k!r}; expected 1 to {count_keys[0]}={experts}")
    step = hf.get("decoder_sparse_step", 1) or 1
    only_dense = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(hf["num_hidden_layers"]) if i in only_dense or (i + 1) % step != 0)
    return {"num_experts": experts, "num_experts_per_tok": top_k, "dense_layers": dense}


def write_experts(count_key: str, config: Any) -> dict[str, Any]:
    return {count_key: config.num_experts, "num_experts_per_tok": config.num_experts_per_tok}


SIGMOID_ROUTING_KEYS = ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                        "n_shared_experts", "first_k_dense_replace", "moe_intermediate_size", "norm_topk_prob")
"""The config.json keys of DeepSeek-V3's mixture of experts (Kimi K2's, GLM-4.5's)."""


def read_sigmoid_routing(hf: dict[str, Any], source: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields of DeepSeek-V3's mixture of experts from config.json's
    ``SIGMOID_ROUTING_KEYS``, ``defaults`` standing in for those it lacks (each family's
    transformers config defaults them differently): the sigmoid router with its groups and
    scaling, ``n_shared_experts`` ungated shared experts as one MLP, and the first
    ``first_k_dense_replace`` layers dense. ``scoring_func`` and ``topk_method`` (DeepSeek's
    own config.json) other than 'sigmoid' and 'noaux_tc' are refused."""
    keys = {**defaults, **{k: hf[k] for k in SIGMOID_ROUTING_KEYS if k in hf}}
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, expected) != expected:
            raise ConfigError(f"{source}: {key}={hf[key]!r} is not supported; llmflow routes with {key}={expected!r}")
    experts = read_experts({**hf, **keys}, source, ("n_routed_experts",))["num_experts"]
    top_k, groups, kept = keys["num_experts_per_tok"], keys["n_group"], keys["topk_group"]
    if not isinstance(groups, int) or groups < 1 or experts % groups or experts // groups < 2:
        raise ConfigError(f"{source}: n_group={groups!r} must split n_routed_experts={experts} into equal groups of "
                          "at least 2 experts (a group's score is the sum of its two best)")
    if not isinstance(kept, int) or not 1 <= kept <= groups:
        raise ConfigError(f"{source}: topk_group={kept!r}; expected 1 to n_group={groups}")
    if not isinstance(top_k, int) or not 1 <= top_k <= kept * (experts // groups):
        raise ConfigError(f"{source}: num_experts_per_tok={top_k!r}; the topk_group={kept} groups kept hold "
                          f"{kept * (experts // groups)} experts")
    shared, dense = keys["n_shared_experts"], keys["first_k_dense_replace"]
    for key, value in (("n_shared_experts", shared), ("first_k_dense_replace", dense)):
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{source}: {key}={value!r}; expected a count of 0 or more")
    width = keys["moe_intermediate_size"]
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": bool(keys["norm_topk_prob"]), "router_scoring": "sigmoid", "n_group": groups,
            "topk_group": kept, "routed_scaling_factor": float(keys["routed_scaling_factor"]),
            "shared_expert_intermediate_size": width * shared, "shared_expert_gated": False,
            "dense_layers": tuple(range(min(dense, hf["num_hidden_layers"])))}


def write_sigmoid_routing(config: ModelConfig) -> dict[str, Any]:
    """The inverse of ``read_sigmoid_routing``: the ``SIGMOID_ROUTING_KEYS`` for an export."""
    return {"n_routed_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "n_group": config.n_group, "topk_group": config.topk_group,
            "routed_scaling_factor": config.routed_scaling_factor,
            "n_shared_experts": config.shared_expert_intermediate_size // config.moe_intermediate_size,
            "first_k_dense_replace": len(config.dense_layers), "moe_intermediate_size": config.moe_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob}


def build_router(config: ModelConfig) -> TopKRouter | GroupLimitedRouter:
    """The router of a MoE layer of ``config``, as its ``router_scoring`` says."""
    if config.router_scoring == "sigmoid":
        return GroupLimitedRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  config.norm_topk_prob, n_group=config.n_group, topk_group=config.topk_group,
                                  routed_scaling_factor=config.routed_scaling_factor)
    return TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
