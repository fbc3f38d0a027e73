"""The tensor-parallel training plan as it lays out each family's parameters, in one process
on torch's fake process group of two ranks (collectives do nothing; placements and local
shapes are those of a real rank): q/k/v and gate/up split by rows, o/down by columns, every
norm whole on each rank — Qwen3's per-head q/k norms included, which see this rank's heads
and whose gradient is a sum over the ranks' heads."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmflow.models import CausalLM, ModelConfig, apply_lora
from llmflow.models.lora import LoraConfig
from llmflow.models.parallelize import parallelize_decoder

TP = 2
SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (1, 1, TP), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def placements(model: CausalLM) -> dict[str, tuple]:
    return {name: tuple(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)}


@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen3", {"head_dim": 24})])
def test_norms_are_whole_and_projections_split(mesh, family, extra):
    model = CausalLM(ModelConfig.from_hf({"model_type": family, **SHAPE, **extra}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan entry naming a module the family lacks warns
        parallelize_decoder(model, mesh)
    laid_out = placements(model)
    assert len(laid_out) == len(list(model.parameters()))
    attn = "model.layers.1.self_attn."
    assert laid_out[attn + "q_proj.weight"] == laid_out[attn + "k_proj.weight"] == (Shard(0),)
    assert laid_out[attn + "o_proj.weight"] == laid_out["model.layers.1.mlp.down_proj.weight"] == (Shard(1),)
    norms = [name for name in laid_out if name.endswith("norm.weight")]
    assert len(norms) == (4 if family == "qwen3" else 2) * 2 + 1
    assert all(laid_out[name] == (Replicate(),) for name in norms)
    if family == "qwen3":
        q_norm = model.get_parameter(attn + "q_norm.weight")
        assert q_norm.to_local().shape == (24,)
        # A step runs on this rank's heads: 2 of the 4 query heads, 1 of the 2 key heads.
        seen = []
        model.get_submodule(attn + "k_norm").register_forward_hook(lambda m, args, out: seen.append(out.shape))
        ids = torch.randint(0, 64, (2, 8))
        model(ids, labels=ids, position_ids=torch.arange(8).expand(2, 8)).backward()
        assert seen == [(2, 8, 1, 24)]
        assert q_norm.grad.placements == (Partial(),)  # summed over the ranks when it is used


def test_lora_keeps_the_qk_norms_frozen_and_whole(mesh):
    model = CausalLM(ModelConfig.from_hf({"model_type": "qwen3", **SHAPE, "head_dim": 24}))
    apply_lora(model, LoraConfig(rank=4))
    parallelize_decoder(model, mesh, lora=True)
    for norm in ("q_norm", "k_norm"):
        weight = model.get_parameter(f"model.layers.0.self_attn.{norm}.weight")
        assert weight.placements == (Replicate(),) and not weight.requires_grad
