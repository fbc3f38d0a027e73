"""The finetune-and-eval flow end to end, in-process, for the families shaped like the frontier
checkpoints (tiny, over the sample's tokenizer): DeepSeek-V3 (MLA, DeepSeek's mixture of experts
after a dense first layer, group-limited routing), GLM-4.5 (a dense first layer, group-limited
routing, q and k norms), gpt-oss with its experts stored MXFP4 (as the Hub's checkpoints hold
them) and Gemma 3 (a sliding window shorter than the sequences). Each run takes the fewest steps
and the smallest evaluation that go through every stage: the export keeps the source's config (the
MXFP4 experts written dense), loads in transformers as the family's class with llmflow's logits
on more tokens than the sliding windows, and the finetune is registered (no gate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from prefect_helpers import task_states
from safetensors.torch import load_file
from test_gpt_oss import quantize_experts_mxfp4

from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval
from llmflow.weights import load_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_env")]

ATOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
# 8 experts in 4 groups of 2, the best 2 groups kept, 3 experts per token, a shared expert; layer 0 dense.
GROUPED_MOE = {"n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
               "moe_intermediate_size": 32, "first_k_dense_replace": 1, "norm_topk_prob": True,
               "routed_scaling_factor": 2.5}
FAMILIES = {
    "deepseek_v3": {"num_hidden_layers": 3, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12,
                    "qk_rope_head_dim": 8, "v_head_dim": 12, "rope_parameters": YARN, **GROUPED_MOE},
    "glm4_moe": {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "use_qk_norm": True,
                 **GROUPED_MOE},
    "gpt_oss": {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 16,
                                    "rope_theta": 150000.0}},
    "gemma3_text": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 16, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}
HF_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
              "gpt_oss": "GptOssForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


@pytest.fixture(autouse=True)
def worker_env(monkeypatch):
    """Workers on CPU, one thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_finetune_eval_runs_every_stage_and_registers(family, prefect_env, sample_tokenizer_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = sample_tokenizer_model(family, **FAMILIES[family])
    if family == "gpt_oss":
        quantize_experts_mxfp4(model, model)
    params = FinetuneEvalParams.model_validate({
        "workspace": str(tmp_path / "ws"), "model": str(model), "version": "test", "seq_length": 64,
        "train": {"steps": 2, "save_interval": 2, "micro_batch_size": 4, "global_batch_size": 4},
        "evaluation": {"limit": 4}, "prompts": ["What is the capital of France?"], "max_new_tokens": 4,
        "registered_model": f"test-{family}", "register_min_gain": None,
    })
    state = finetune_eval(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    states = task_states(state.state_details.flow_run_id)
    assert all(set(runs) == {"Completed"} for runs in states.values()), states
    assert {"convert", "tokenize-instruction", "eval-mmlu", "train", "export", "infer", "register"} <= set(states)
    result = state.result()

    # The export is the source model's config (gpt-oss's experts dense: no quantization_config).
    exported = Path(result["model"])
    source = json.loads((model / "config.json").read_text())
    source.pop("quantization_config", None)
    assert json.loads((exported / "config.json").read_text()) == source
    if family == "gpt_oss":
        names = set(load_file(exported / "model.safetensors"))
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith("_blocks") for n in names)
    theirs = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(theirs).__name__ == HF_CLASSES[family]
    ours = load_hf_model(exported).eval()
    ids = torch.randint(0, theirs.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, expected = ours(ids).float(), theirs(ids).logits.float()
    print(f"{family}: largest logit difference {(got - expected).abs().max():.1e}")
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0.0)

    assert result["gate"]["passed"] and result["gate"]["rule"] == "always"
    assert result["registered"] == {"name": f"test-{family}", "version": "1", "source": result["model"]}
    (version,) = MlflowClient(prefect_env["mlflow_uri"]).search_model_versions(f"name = 'test-{family}'")
    assert version.source == result["model"]
