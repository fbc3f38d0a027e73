"""``llmflow eval mmlu`` against the real lm-evaluation-harness's hf backend (``lm_eval --model
hf``) for the families beyond the dense Llama shape, each a tiny random model over the sample's
tokenizer reading the same sample subject: the mixtures of experts (Qwen3-MoE, and Qwen3.5-MoE
with its Gated DeltaNet layers) and the frontier families (DeepSeek-V3's Multi-head Latent
Attention and group-limited routing, GLM-4.5, gpt-oss's sinks and biased experts, Gemma 3's
sliding window and soft-capping), shaped as in the finetune-and-eval flow's tests. The same four
log-likelihoods of every question, and so the same answers."""

from __future__ import annotations

import pytest
from harness_runs import harness_samples, harness_task, ours, run_harness
from test_frontier_flows import FAMILIES as FRONTIER

pytestmark = pytest.mark.slow

FAMILIES = {
    "qwen3_moe": {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    # Qwen3.5-MoE: Gated DeltaNet layers 0-2 and gated attention on layer 3, a shared expert.
    "qwen3_5_moe_text": {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 48},
    **FRONTIER,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mmlu_predictions_are_lm_evals(family, sample_assets, sample_tokenizer_model, tmp_path):
    sample = sample_assets()
    model = sample_tokenizer_model(family, **FAMILIES[family])
    subject = sample / "mmlu" / "hf" / "geography"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    harness_task(tasks, "llmflow_mmlu_geography", "mmlu/default/mmlu_high_school_geography.yaml",
                 {split: subject / f"{split}-00000-of-00001.parquet" for split in ("dev", "test")})
    with open(tasks / "llmflow_mmlu_geography.yaml", "a") as f:  # the sample subject's own name
        f.write('description: "The following are multiple choice questions (with answers) about geography.\\n\\n"\n')
    run_harness(model, "llmflow_mmlu_geography", tasks, tmp_path / "harness", shots=5)
    _, predictions = ours(tmp_path, "mmlu", model, sample / "mmlu" / "hf", "--shots", "5", "--subjects", "geography")
    theirs = harness_samples(tmp_path / "harness", "llmflow_mmlu_geography")
    assert len(theirs) == len(predictions) == 50
    largest = 0.0
    for sample_row, prediction in zip(theirs, predictions, strict=True):
        scores = [float(response[0]) for response in sample_row["filtered_resps"]]
        largest = max(largest, *(abs(a - b) for a, b in zip(prediction["scores"], scores, strict=True)))
        # Within 1e-5 as a rule; 1e-3 allows a token whose two top experts' probabilities tie to
        # within fp32 rounding, which batching can route either way (7.6e-5 seen once in a
        # 5-shot continuation's sum).
        assert prediction["scores"] == pytest.approx(scores, rel=0, abs=1e-3), sample_row["doc_id"]
        assert prediction["prediction"] == "ABCD"[max(range(4), key=scores.__getitem__)]
    print(f"{family}: largest log-likelihood difference {largest:.1e}")
