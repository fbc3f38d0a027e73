"""Training a mixture of experts (a tiny Qwen3-MoE on the sample data): the load-balancing
auxiliary loss is trained and reported with the experts' load, and two data-parallel ranks,
each holding half of every micro-batch, train what one process does (fp32, 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from forked_workers import train_forked
from torch.distributed.checkpoint import FileSystemReader
from train_helpers import TOLERANCE, assert_same, config, resume_from, step_metrics, training_assets

from llmflow.models import ModelConfig
from llmflow.train.preflight import check_training, parallel_problems
from llmflow.weights.tokenizer_files import copy_tokenizer_files

# The gradient norm too: Adam's update hardly changes when a gradient is off by a constant factor.
AUX_COEF = 0.05
# Compared between layouts, with the precision the step line prints them at. The gradient
# norm too: Adam's update hardly changes when a gradient is off by a constant factor.
TOLERANCES = {"loss": TOLERANCE, "grad_norm": 1e-4, "moe_aux_loss": TOLERANCE, "max_expert_load": 0.01}


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory, make_hf_model) -> dict[str, Path]:
    """The sample data tokenized, and a tiny Qwen3-MoE (the sample's vocabulary and tokenizer)
    whose config.json asks for its auxiliary loss, as transformers would train it."""
    assets = training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("moe"))
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    _, path = make_hf_model("qwen3_moe", vocab_size=vocab, num_key_value_heads=2, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                   output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    copy_tokenizer_files(assets["model"], path)
    return {**assets, "model": path}


def train(assets, out: Path, nproc: int = 1, **overrides) -> dict[int, dict[str, float]]:
    cfg = config(assets, out, **{"steps": 4, **overrides})
    return step_metrics(train_forked(cfg, nproc, env={"OMP_NUM_THREADS": "1"}), TOLERANCES)


def expert_chunks(out: Path) -> list[int]:
    """Where each rank's piece of layer 0's gate_proj experts starts in the saved checkpoint."""
    metadata = FileSystemReader(str(max(out.glob("step_*")))).read_metadata()
    return sorted(c.offsets[0] for c in metadata.state_dict_metadata["model.model.layers.0.mlp.experts.gate_proj"].chunks)


@pytest.mark.slow
def test_expert_parallel_ranks_train_what_one_process_does_and_resume_on_other_layouts(assets, tmp_path):
    """ep=2: each of two ranks holds half the experts (saved so: two pieces of every expert
    tensor) and exchanges tokens by all-to-all, with activation checkpointing; losses, gradient
    norms and routing equal one process's, which holds every expert. Its checkpoint resumes at
    ep=1, and a pp=2 x ep=2 run's at pp=1."""
    one = train(assets, tmp_path / "one", steps=6, micro_batch_size=4)
    # Recomputing the layers in backward repeats their all-to-alls.
    ep = train(assets, tmp_path / "ep", nproc=2, dp=2, ep=2, micro_batch_size=2, steps=6, save_interval=3,
               activation_checkpointing="full")
    assert sorted(ep) == list(range(1, 7)) and expert_chunks(tmp_path / "ep") == [0, 2]
    assert_same(ep, one, TOLERANCES)
    resume_from(tmp_path / "ep", 3)
    resumed = train(assets, tmp_path / "ep", nproc=2, dp=2, micro_batch_size=2, steps=6)
    assert sorted(resumed) == [4, 5, 6]
    assert_same(resumed, one, TOLERANCES)

    # The auxiliary loss is not trained (nor reported) under pp: compare runs without it.
    plain = train(assets, tmp_path / "plain", steps=6, micro_batch_size=4, router_aux_loss_coef=0.0)
    pipelined = train(assets, tmp_path / "pp", nproc=4, pp=2, dp=2, ep=2, micro_batch_size=2, steps=6,
                      save_interval=3, router_aux_loss_coef=0.0)
    assert_same(pipelined, {step: {"loss": m["loss"], "grad_norm": m["grad_norm"]} for step, m in plain.items()}, TOLERANCES)
    resume_from(tmp_path / "pp", 3)
    resumed = train(assets, tmp_path / "pp", nproc=2, dp=2, ep=2, micro_batch_size=2, steps=6, router_aux_loss_coef=0.0)
    assert sorted(resumed) == [4, 5, 6]
    assert_same(resumed, plain, TOLERANCES)

# Its gradient norms (about 5) are printed to 4 decimals: two ranks' fp32 sums, a few 1e-5 off
# one process's, can move the last printed digit by 2.
HYBRID_TOLERANCES = {**TOLERANCES, "grad_norm": 3e-4}


@pytest.mark.slow
def test_a_hybrid_linear_attention_moe_trains_at_ep2_like_one_process_and_resumes_at_ep1(
        assets, make_hf_model, tmp_path):
    """Qwen3.5-MoE (Gated DeltaNet layers 0-2, gated attention on layer 3, a shared expert;
    config.json asking for the auxiliary loss): two expert-parallel ranks train what one
    process does, and their step-2 checkpoint (every expert tensor saved in two pieces) resumes
    on two plain data-parallel ranks, each holding every expert, continuing one process's run."""
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    _, path = make_hf_model("qwen3_5_moe_text", vocab_size=vocab, num_hidden_layers=4, num_key_value_heads=2,
                            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, output_router_logits=True,
                            router_aux_loss_coef=AUX_COEF)
    copy_tokenizer_files(assets["model"], path)
    hybrid = {**assets, "model": path}
    one = train(hybrid, tmp_path / "one", micro_batch_size=4)
    ep = train(hybrid, tmp_path / "ep", nproc=2, dp=2, ep=2, micro_batch_size=2, save_interval=2)
    assert sorted(ep) == [1, 2, 3, 4] and expert_chunks(tmp_path / "ep") == [0, 2]
    assert_same(ep, one, HYBRID_TOLERANCES)
    assert one[1]["moe_aux_loss"] >= 1.0
    resume_from(tmp_path / "ep", 2)
    resumed = train(hybrid, tmp_path / "ep", nproc=2, dp=2, micro_batch_size=2)
    assert sorted(resumed) == [3, 4]
    assert_same(resumed, one, HYBRID_TOLERANCES)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "cp"])
def test_sequence_shards_route_their_own_tokens_and_train_what_one_process_does(assets, tmp_path, parallel):
    """tp=2 (attention split by heads) and cp=2 (each rank half of every sequence), each rank
    routing its own half of the sequence through whole experts; and the same with dp=2 x ep=2
    on four ranks, the experts also split (their tokens exchanged within each shard's ep
    group). Losses, gradient norms, the auxiliary loss and the experts' load equal one process's."""
    one = train(assets, tmp_path / "one", micro_batch_size=4)
    two = train(assets, tmp_path / "two", nproc=2, micro_batch_size=4, **{parallel: 2})
    assert sorted(two) == [1, 2, 3, 4]
    assert_same(two, one, TOLERANCES)
    experts = train(assets, tmp_path / "experts", nproc=4, dp=2, ep=2, micro_batch_size=2, **{parallel: 2})
    assert sorted(experts) == [1, 2, 3, 4]
    assert_same(experts, one, TOLERANCES)


@pytest.mark.slow
@pytest.mark.parametrize("experts", [False, True], ids=["frozen-experts", "adapted-experts"])
def test_lora_on_a_mixture_of_experts_trains_alike_with_experts_split(assets, tmp_path, experts):
    """LoRA adapters on attention over the experts, frozen or adapted too (target_parameters:
    each expert's adapters split over the ranks with it), which ep=2 splits: the losses,
    gradient norms and routing of one process; the ep=2 run's adapters merged by
    ``llmflow export --merge-lora`` equal the run's model with its adapters merged in memory,
    and exported as a PEFT adapter they load into PEFT on transformers' model with its logits."""
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    if experts:
        lora["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    one = train(assets, tmp_path / "one", micro_batch_size=4, lora=lora)
    ep = train(assets, tmp_path / "ep", nproc=2, dp=2, ep=2, micro_batch_size=2, lora=lora)
    assert sorted(ep) == [1, 2, 3, 4]
    assert_same(ep, one, TOLERANCES)
    if experts:
        import torch
        from safetensors.torch import load_file

        from llmflow.weights import load_model, save_hf_model
        from llmflow.weights.export import ExportConfig, export

        exported = export(ExportConfig(ckpt=tmp_path / "ep", out=tmp_path / "merged", merge_lora=True))
        merged, _ = load_model(tmp_path / "ep")
        expected = load_file(save_hf_model(merged, tmp_path / "in-memory") / "model.safetensors")
        written = load_file(exported / "model.safetensors")
        assert sorted(written) == sorted(expected)
        base = load_file(assets["model"] / "model.safetensors")
        moved = [n for n in expected if ".experts." in n and not torch.equal(expected[n], base[n])]
        assert moved  # the experts' adapters trained
        for name, tensor in expected.items():
            torch.testing.assert_close(written[name], tensor, atol=1e-6, rtol=0, msg=name)
        # Without --merge-lora, PEFT's layout: PeftModel on transformers' model computes the run's logits.
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        adapter = export(ExportConfig(ckpt=tmp_path / "ep", out=tmp_path / "peft"))
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]), adapter).eval()
        ids = torch.arange(48).view(2, 24) % merged.config.vocab_size
        with torch.no_grad():
            torch.testing.assert_close(peft(ids).logits, merged.eval()(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, nproc, problem", [
    ({"dp": 2, "ep": 3}, 2, "ep=3 does not divide the model's num_experts=4"),
    ({"dp": 3, "ep": 2}, 3, "ep=2 does not divide dp=3: expert-parallel ranks are data-parallel ranks"),
    ({"pp": 2, "num_layer_list": [1, 1]}, 2,
     ("router_aux_loss_coef=0.05: a mixture of experts' auxiliary loss is not trained under pp=2; set "
     "router_aux_loss_coef=0 (the default unless config.json sets output_router_logits), or pp=1")),
])
def test_expert_layouts_a_model_cannot_take_are_refused_before_launch(assets, tmp_path, overrides, nproc, problem):
    cfg = config(assets, tmp_path / "run", **{"micro_batch_size": 1, "global_batch_size": 6, **overrides})
    with pytest.raises(ValueError) as caught:
        check_training(cfg, nproc, {"LLMFLOW_DEVICE": "cpu"})
    assert f"  - {problem}" in str(caught.value).splitlines()


def test_expert_parallelism_needs_experts(sample_assets, tmp_path):
    sample = sample_assets(instruct_rows=300, documents=60)
    assert parallel_problems(2, 1, 2, ModelConfig.from_file(sample / "model"), ep=2) == [
        "ep=2 needs a mixture-of-experts model; qwen2 has no experts"]
