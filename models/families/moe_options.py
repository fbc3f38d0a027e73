"""The config.json keys of a mixture-of-experts model that Qwen2-MoE, Qwen3-MoE and Mixtral
share: how many experts, how many per token, and which layers stay dense."""

from __future__ import annotations

from typing import Any

from llmflow.models.config import ConfigError


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
