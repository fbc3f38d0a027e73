"""MFU's FLOPs per token (``llmflow.train.metrics.flops_per_token``) against the matrix
multiplications a real training step of a tiny model runs, counted by torch's
``FlopCounterMode`` with the reference kernels (attention as two matmuls, each expert's rows
as one matmul): Multi-head Latent Attention, dense first layers, sigmoid-routed experts and
an ungated shared expert (DeepSeek-V3), GLM-4.5's attention with its experts, and a gated
shared expert (Qwen2-MoE)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmflow import kernels
from llmflow.models import CausalLM, ModelConfig
from llmflow.train.metrics import flops_per_token

SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4}
ROUTED = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
          "first_k_dense_replace": 1}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24}
CONFIGS = {
    "deepseek_v3": {"model_type": "deepseek_v3", **SHAPE, **MLA, **ROUTED, "n_shared_experts": 1},
    "deepseek_v3 q_proj": {"model_type": "deepseek_v3", **SHAPE, **MLA, **ROUTED, "q_lora_rank": None},
    "glm4_moe": {"model_type": "glm4_moe", **SHAPE, **ROUTED, "num_key_value_heads": 2, "head_dim": 16,
                 "attention_bias": True},
    "qwen2_moe": {"model_type": "qwen2_moe", **SHAPE, "num_key_value_heads": 2, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_flops_per_token_equal_the_counted_matmuls_of_a_training_step(name):
    config = ModelConfig.from_hf(CONFIGS[name])
    model = CausalLM(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    batch, seq = 2, 32
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with kernels.use_kernels(kernels.REFERENCE), FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).backward()
    assert counter.get_total_flops() == flops_per_token(config, seq) * batch * seq
