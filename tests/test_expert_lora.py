"""LoRA on the routed experts (``LoraConfig.target_parameters``) against PEFT's ParamWrapper on
transformers' own models: tiny Qwen3-MoE (transformers' fused ``gate_up_proj`` [E, 2I, H], which
llmflow keeps as separate gate and up weights), DeepSeek-V3 (a dense layer, group-limited
routing, a shared expert) and gpt-oss (``gate_up_proj`` [E, H, 2I] with interleaved columns,
biases). With PEFT's adapters (random, nonzero) copied in, the logits, every adapter's
gradient and the merged model's logits equal PEFT's (1e-5, fp32); the adapters start as PEFT
starts them, and bad targets are refused naming what exists."""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.lora.layer import ParamWrapper
from test_frontier_flows import FAMILIES

from llmflow.models.lora import LoraConfig, apply_lora, merge_lora
from llmflow.weights import load_hf_model

ATOL = 1e-5
RANK, ALPHA = 4, 8
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MODELS = {
    "qwen3_moe": {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "deepseek_v3": FAMILIES["deepseek_v3"],
    "gpt_oss": FAMILIES["gpt_oss"],
}


def peft_pair(make_hf_model, family: str):
    """(PEFT's model over transformers', llmflow's model with the same adapters)."""
    hf, path = make_hf_model(family, **MODELS[family])
    theirs = get_peft_model(hf, PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[],
                                               target_parameters=TARGETS))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    ours = load_hf_model(path)
    apply_lora(ours, LoraConfig(rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=TARGETS))
    for name, module in theirs.named_modules():
        if isinstance(module, ParamWrapper):
            layer = re.search(r"layers\.(\d+)\.", name)[1]
            adapter = ours.model.layers[layer].mlp.experts.lora[module.parameter_name]
            copy_from_peft(module, adapter)
    return theirs.eval(), ours.eval()


@torch.no_grad()
def copy_from_peft(module: ParamWrapper, adapter) -> None:
    """PEFT's lora_A [E r, in] (rows expert-major) and lora_B [out, r E] (columns rank-major)
    into llmflow's [E, r, in] and [E, out, r]."""
    experts = module.num_experts
    a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
    adapter.lora_A.weight.copy_(a.view(experts, -1, a.shape[-1]))
    adapter.lora_B.weight.copy_(b.view(b.shape[0], -1, experts).permute(2, 0, 1))


def peft_gradients(theirs) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    grads = {}
    for name, module in theirs.named_modules():
        if isinstance(module, ParamWrapper):
            experts = module.num_experts
            a, b = module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad
            grads[(re.search(r"layers\.(\d+)\.", name)[1], module.parameter_name)] = (
                a.view(experts, -1, a.shape[-1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1))
    return grads


@pytest.mark.parametrize("family", list(MODELS))
def test_expert_adapters_compute_what_peft_does(family, make_hf_model, tokens):
    theirs, ours = peft_pair(make_hf_model, family)
    ids = tokens(2, 24, vocab=ours.config.vocab_size)
    expected, got = theirs(ids).logits, ours(ids)
    print(f"{family}: largest logit difference {(got - expected).abs().max():.1e}")
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    expected.square().mean().backward()
    got.square().mean().backward()
    reference = peft_gradients(theirs)
    adapted = {(n, t) for n, layer in ours.model.layers.items()
               if getattr(layer.mlp, "experts", None) is not None for t in layer.mlp.experts.lora}
    assert adapted == set(reference) and adapted
    for (layer, target), (grad_a, grad_b) in reference.items():
        adapter = ours.model.layers[layer].mlp.experts.lora[target]
        torch.testing.assert_close(adapter.lora_A.weight.grad, grad_a, atol=ATOL, rtol=0)
        torch.testing.assert_close(adapter.lora_B.weight.grad, grad_b, atol=ATOL, rtol=0)
    assert not any(p.requires_grad for n, p in ours.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        merge_lora(ours)
        assert not any("lora" in n for n, _ in ours.named_parameters())
        torch.testing.assert_close(ours(ids), theirs.merge_and_unload()(ids).logits, atol=ATOL, rtol=0)


def test_expert_adapters_start_as_peft_starts_them(make_hf_model):
    """lora_A kaiming-uniform per row of PEFT's [E r, in] (each row's fan-in is in), lora_B zero:
    the adapted model computes the base model's output."""
    _, path = make_hf_model("qwen3_moe", **MODELS["qwen3_moe"])
    ours = load_hf_model(path)
    apply_lora(ours, LoraConfig(rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=["experts.down_proj"]),
               generator=torch.Generator().manual_seed(0))
    adapter = ours.model.layers["0"].mlp.experts.lora["down_proj"]
    expected = torch.empty(4 * RANK, 32)
    torch.nn.init.kaiming_uniform_(expected, a=5**0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(adapter.lora_A.weight.view(-1, 32), expected)
    assert not adapter.lora_B.weight.any() and list(ours.model.layers["0"].mlp.experts.lora) == ["down_proj"]


@pytest.mark.parametrize("config, message", [
    ({"target_parameters": ["experts.up_proj"]}, ("match no expert weight of the model; its routed experts' weights are "
                                                 "['gate_up_proj', 'down_proj']")),
    ({"target_modules": []}, "target_modules and target_parameters are both empty"),
])
def test_bad_expert_targets_are_refused(make_hf_model, config, message):
    _, path = make_hf_model("qwen3_moe", **MODELS["qwen3_moe"])
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_lora(load_hf_model(path), LoraConfig(**{"target_modules": [], **config}))
