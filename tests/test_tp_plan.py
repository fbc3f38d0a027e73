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


HYBRID = {**SHAPE, "num_hidden_layers": 4, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 0}


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_gated_deltanet_splits_by_key_head_groups(mesh, family):
    """Layers 0-2 Gated DeltaNet (2 key heads, 4 value heads of 8), layer 3 gated attention:
    each rank holds 1 key head and its 2 value heads, and 2 of the 4 attention heads with their
    gates. in_proj_qkv and conv1d keep the plain row split (the Hugging Face layout); the rest
    of the DeltaNet's per-head tensors split by heads, out_proj by columns, its norm whole."""
    model = CausalLM(ModelConfig.from_hf({"model_type": family, **HYBRID}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallelize_decoder(model, mesh)
    laid_out = placements(model)
    assert len(laid_out) == len(list(model.parameters()))
    linear = "model.layers.0.linear_attn."
    fused = family == "qwen3_next"
    projections = ["in_proj_qkvz", "in_proj_ba"] if fused else ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    for name in [*(f"{p}.weight" for p in projections), "conv1d.weight", "A_log", "dt_bias"]:
        assert laid_out[linear + name] == (Shard(0),), name
        param = model.get_parameter(linear + name)
        assert param.to_local().shape[0] == param.shape[0] // TP, name
    assert laid_out[linear + "out_proj.weight"] == (Shard(1),)
    assert laid_out[linear + "norm.weight"] == (Replicate(),)
    assert model.get_parameter("model.layers.3.self_attn.q_proj.weight").to_local().shape == (2 * 2 * 8, 32)
    seen = []
    model.get_submodule(linear + "norm").register_forward_hook(lambda m, args, out: seen.append(out.shape))
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids, position_ids=torch.arange(8).expand(2, 8)).backward()
    assert seen == [(2, 8, 2, 8)]  # this rank's 2 value heads, the whole sequence
    assert model.get_parameter(linear + "A_log").grad.placements == (Shard(0),)
