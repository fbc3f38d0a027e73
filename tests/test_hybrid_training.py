"""Training the hybrid models (Gated DeltaNet and gated attention layers: Qwen3.5 dense and
MoE, Qwen3-Next) on the sample data: tensor parallelism over the linear-attention heads
(with and without LoRA adapters on the DeltaNet's projections), pipeline stages cut between
linear and attention layers, and activation checkpointing each train what one process does
(fp32 losses within 1e-5), packed documents resetting the DeltaNet's state; a tp=2 checkpoint
stores one process's weights in the Hugging Face layout; and the layouts the heads cannot
divide are refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import assert_close, config, run, train_in_subprocess, training_assets

from llmflow.models import ModelConfig
from llmflow.train.preflight import parallel_problems
from llmflow.weights import load_model
from llmflow.weights.tokenizer_files import copy_tokenizer_files

STEPS = 4
# Layers 0-2 Gated DeltaNet (2 key heads, each serving 2 value heads), layer 3 gated attention.
HYBRID = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
          "linear_conv_kernel_dim": 4}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
MODELS = {
    "qwen3_5": ("qwen3_5_text", HYBRID),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**HYBRID, **EXPERTS}),
    "qwen3_next": ("qwen3_next", {**HYBRID, "num_experts": 0}),
}
# The DeltaNet's projections of the unfused layout (in_proj_qkv is split by head groups), the
# attention's query and gate, and a row-parallel out_proj.
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj"]}
WEIGHT_TOLERANCE = 1e-6
"""Mean absolute difference of a trained tensor from one process's (measured: 1e-7; the weights
are ~0.1, so rows stored in another order would be ~0.1 off)."""
DOCUMENTS = {"data": {"kind": "pretrain", "document_attention": True}}


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory, make_hf_model) -> dict[str, Path]:
    """The sample data tokenized, and each tiny hybrid model over the sample's vocabulary."""
    assets = training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("hybrid"))
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    for name, (family, overrides) in MODELS.items():
        _, path = make_hf_model(family, vocab_size=vocab, **overrides)
        copy_tokenizer_files(assets["model"], path)
        assets[name] = path
    return assets


# The learning rate is a third of the other families' tests: the gradients of A_log and dt_bias
# (the decay) sum many cancelling terms, and one process's fp32 gradient of them is itself 1e-4
# off (relative) the float64 one, as a tp=2 run's is; at lr 3e-3 Adam turns that into 1.4e-5 of
# loss by step 3 (measured), at 1e-3 into 3e-6.
OPTIM = {"lr": 1e-3, "warmup_steps": 2}


def settings(assets, out: Path, model: str, documents: bool = True, **overrides):
    data = {"data": {**DOCUMENTS["data"], "paths": [str(assets["wiki"])]}} if documents else {}
    return config(assets, out, model=str(assets[model]), steps=STEPS, optim=OPTIM, **data, **overrides)


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid-ref")


@pytest.fixture(scope="module")
def reference(assets, reference_runs) -> dict[str, dict[int, float]]:
    """Single-process losses, packed documents: each model, and Qwen3.5 with LoRA."""
    root = reference_runs
    losses = {name: train_in_subprocess(settings(assets, root / name, name)) for name in MODELS}
    losses["qwen3_5-lora"] = train_in_subprocess(settings(assets, root / "lora", "qwen3_5", lora=LORA))
    return losses


LAYOUTS = {  # name: (model, settings, ranks)
    "qwen3_5-tp2": ("qwen3_5", {"tp": 2}, 2),
    "qwen3_5-pp2": ("qwen3_5", {"pp": 2}, 2),
    "qwen3_5-pp2xtp2": ("qwen3_5", {"pp": 2, "tp": 2}, 4),
    "qwen3_5-tp2-lora": ("qwen3_5-lora", {"tp": 2, "lora": LORA}, 2),
    "qwen3_5_moe-tp2": ("qwen3_5_moe", {"tp": 2}, 2),
    "qwen3_next-tp2": ("qwen3_next", {"tp": 2}, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_matches_one_process(assets, reference, reference_runs, tmp_path, layout):
    """pp=2 puts layers 0-1 (linear) on one stage and 2-3 (linear, attention) on the other
    (under tp=2 too).
    A full-weight tp=2 checkpoint stores what one process's does, under the same names and
    layout (in_proj_qkv and conv1d rows as Hugging Face orders them, whatever tp)."""
    want, overrides, nproc = LAYOUTS[layout]
    model = want.removesuffix("-lora")
    got = run(settings(assets, tmp_path / "run", model, **overrides), nproc)
    assert sorted(got) == list(range(1, STEPS + 1))
    print(f"{layout}: largest loss difference {max(abs(got[s] - reference[want][s]) for s in got):.1e}")
    assert_close(got, reference[want])
    if "tp" in overrides and "lora" not in overrides:
        ours, one = load_model(tmp_path / "run")[0].state_dict(), load_model(reference_runs / model)[0].state_dict()
        assert ours.keys() == one.keys()
        differences = {name: (tensor - one[name]).abs().mean().item() for name, tensor in ours.items()}
        print(f"{layout}: largest mean weight difference {max(differences.values()):.1e}")
        assert max(differences.values()) <= WEIGHT_TOLERANCE, differences


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_trains_what_no_checkpointing_does(assets, reference, tmp_path, mode):
    got = train_in_subprocess(settings(assets, tmp_path / "run", "qwen3_5", activation_checkpointing=mode))
    assert sorted(got) == list(range(1, STEPS + 1))
    print(f"AC {mode}: largest loss difference {max(abs(got[s] - reference['qwen3_5'][s]) for s in got):.1e}")
    assert_close(got, reference["qwen3_5"])


def test_tensor_parallel_degree_must_divide_the_linear_key_heads():
    model = ModelConfig.from_hf({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
                                 "num_key_value_heads": 4, "head_dim": 16, **{k: v for k, v in HYBRID.items()
                                                                              if k.startswith("linear_")}})
    assert parallel_problems(4, 4, model=model) == [
        "model linear_num_key_heads=2 (Gated DeltaNet key heads) is not divisible by tp=4"]
    assert parallel_problems(2, 2, model=model) == []
