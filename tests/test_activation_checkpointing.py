"""Activation checkpointing, applied from outside the model: ``full`` and ``selective`` give
the gradients of no checkpointing, ``full`` runs every layer's forward again in backward, and
``selective`` re-runs only the cheap ops, keeping the matrix multiplications' outputs."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmflow.models import CausalLM, ModelConfig
from llmflow.models.parallelize import apply_ac
from llmflow.train.config import TrainConfig

LAYERS = 2


class OpCounts(TorchDispatchMode):
    """How often each aten op runs."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def tiny_model() -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return CausalLM(config)


def forward_backward(model: CausalLM, ids: torch.Tensor) -> tuple[Counter, Counter, dict[str, torch.Tensor]]:
    """Op counts of the forward and of the backward pass, and the gradients."""
    with OpCounts() as forward:
        loss = model(ids).float().logsumexp(-1).mean()
    with OpCounts() as backward:
        loss.backward()
    return forward.counts, backward.counts, {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Counter, Counter, dict[str, torch.Tensor]]]:
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    base = tiny_model()
    results = {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        if mode != "none":
            apply_ac(model, mode)
        results[mode] = forward_backward(model, ids)
    return results


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_the_gradients(runs, mode):
    want, got = runs["none"][2], runs[mode][2]
    assert [name.replace("._checkpoint_wrapped_module", "") for name in got] == list(want)
    for (name, grad), expected in zip(got.items(), want.values()):
        assert torch.allclose(grad, expected, atol=1e-6, rtol=0), name


def test_full_recomputes_every_layer_and_selective_only_the_cheap_ops(runs):
    forward, plain_backward, _ = runs["none"]
    _, full_backward, _ = runs["full"]
    _, selective_backward, _ = runs["selective"]
    # Each layer holds 7 projections; the output projection runs outside the layers.
    layer_mm = forward["mm"] - 1
    assert layer_mm == 7 * LAYERS
    # full runs the layers' projections again (torch stops a recomputation once it has every
    # tensor backward needs: a layer's last projection is not among them).
    assert plain_backward["mm"] + LAYERS * 6 <= full_backward["mm"] <= plain_backward["mm"] + layer_mm
    assert selective_backward["mm"] == plain_backward["mm"]
    # The cheap ops (SwiGLU's silu, RMSNorm's rsqrt) are run again by both.
    for op in ("silu", "rsqrt"):
        assert full_backward[op] > plain_backward[op] and selective_backward[op] > plain_backward[op], op


def test_older_configs_boolean_checkpointing_still_reads():
    base = {"model": "m", "out": "o", "data": {"kind": "pretrain", "paths": ["d"]}, "steps": 1}
    assert TrainConfig.model_validate({**base, "activation_checkpointing": True}).activation_checkpointing == "full"
    assert TrainConfig.model_validate({**base, "activation_checkpointing": False}).activation_checkpointing == "none"
    assert TrainConfig.model_validate(base).activation_checkpointing == "none"
