"""GLM-4.5 (``glm4_moe``) and DeepSeek-V3's routing against transformers on tiny random weights
(fp32, eager attention) shaped like GLM-4.5-Air: partial rotary, q/k/v biases (q/k norms in
the GLM-4.5 case), a dense first layer, then the sigmoid router with a random nonzero
``e_score_correction_bias``, groups that limit the choice, renormalised weights scaled by
``routed_scaling_factor``, and two ungated shared experts. Checked: logits, greedy generation,
the bit-exact checkpoint round trips (the bias buffer included; through convert and export
too), the router alone against transformers' ``Glm4MoeTopkRouter``, the auxiliary-loss-free
bias update against megatron-core's ``get_updated_expert_bias``, the sequence-wise auxiliary
loss against megatron-core's ``seq_aux_loss``, what config.json keys and training options are
refused, and two expert-parallel ranks training with both balancing options as one process
does."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from test_generate import VOCAB, add_tokenizer, hf_greedy

from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer.generate import GenerateConfig, generate
from llmflow.models import ModelConfig
from llmflow.models.blocks.moe import MoE, Routing, sequence_balancing_loss
from llmflow.models.blocks.moe_routing import GroupLimitedRouter, corrected_bias
from llmflow.models.config import ConfigError
from llmflow.weights import load_hf_model, load_model, save_hf_model

ATOL = 1e-5
BATCH, SEQ = 2, 24

# 8 experts in 4 groups of 2, the best 2 groups kept, 3 experts per token.
ROUTING = {"n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
           "moe_intermediate_size": 32, "first_k_dense_replace": 1, "norm_topk_prob": True,
           "routed_scaling_factor": 2.5}
SHAPE = {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16, **ROUTING}
CASES = {
    "air": {**SHAPE, "attention_bias": True, "use_qk_norm": False},
    "glm4_5": {**SHAPE, "attention_bias": False, "use_qk_norm": True, "tie_word_embeddings": True},
}


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def hf_model(make_hf_model, case, **extra):
    """The tiny transformers model of ``case``, each router's correction bias random and
    nonzero (transformers initialises it to zero), saved again with it."""
    hf, path = make_hf_model("glm4_moe", **CASES[case], **extra)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.1 * torch.randn(bias.shape, generator=g))
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, make_hf_model, tokens):
    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path).eval()
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits)
    layers = list(ours.model.layers.values())
    assert not isinstance(layers[0].mlp, MoE) and all(isinstance(layer.mlp, MoE) for layer in layers[1:])
    for layer, theirs in zip(layers[1:], hf.model.layers[1:], strict=True):
        assert isinstance(layer.mlp.gate, GroupLimitedRouter) and layer.mlp.shared_expert is None
        assert torch.equal(layer.mlp.gate.e_score_correction_bias, theirs.mlp.gate.e_score_correction_bias)
        assert layer.mlp.shared_experts.gate_proj.weight.shape == (2 * 32, 64)
    assert ours.model.inv_freq.shape == (int(16 * 0.5) // 2,)
    assert (layers[0].self_attn.q_norm is not None) == hf.config.use_qk_norm
    assert (layers[0].self_attn.q_proj.bias is not None) == hf.config.attention_bias
    assert layers[0].self_attn.o_proj.bias is None


def test_the_bias_and_the_groups_change_the_choice(make_hf_model, tokens):
    """Without the bias, or without the group limit, some tokens pick other experts: both matter."""
    _, path = hf_model(make_hf_model, "air")
    router = load_hf_model(path).model.layers["1"].mlp.gate
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        chosen = router(x)[2].sort(dim=-1).values
        bias = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        unbiased = router(x)[2].sort(dim=-1).values
        router.e_score_correction_bias.copy_(bias)
        router.topk_group = router.n_group
        ungrouped = router(x)[2].sort(dim=-1).values
    assert (chosen != unbiased).any(dim=-1).sum() > 10
    assert (chosen != ungrouped).any(dim=-1).sum() > 10


def test_router_matches_transformers_router(make_hf_model):
    """Our router against ``Glm4MoeTopkRouter`` holding the same weight and bias: the same
    experts in the same order, weights within 1e-6; and its probabilities are megatron-core's
    normalised sigmoid scores."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    hf, path = hf_model(make_hf_model, "air")
    ours = load_hf_model(path).model.layers["2"].mlp.gate
    theirs = hf.model.layers[2].mlp.gate
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        probabilities, weights, experts = ours(x)
        logits, their_weights, their_experts = theirs(x)
    assert torch.equal(experts, their_experts)
    assert_close(weights, their_weights, atol=1e-6)
    _, scores = compute_routing_scores_for_aux_loss(logits, 3, "sigmoid")
    assert_close(probabilities, scores, atol=1e-7)


def test_a_cast_model_keeps_its_correction_biases_in_fp32(make_hf_model):
    _, path = hf_model(make_hf_model, "air")
    model = load_hf_model(path)
    bias = model.model.layers["1"].mlp.gate.e_score_correction_bias.clone()
    model.to(torch.bfloat16)
    kept = model.model.layers["1"].mlp.gate.e_score_correction_bias
    assert kept.dtype == torch.float32 and torch.equal(kept, bias)
    assert model.model.layers["1"].mlp.gate.weight.dtype == torch.bfloat16
    loaded = load_hf_model(path, dtype=torch.bfloat16).model.layers["1"].mlp.gate.e_score_correction_bias
    assert loaded.dtype == torch.float32 and torch.equal(loaded, bias)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers(case, make_hf_model):
    """Left-padded prompts of 7, 3, 12 and 1 tokens: each row generates what transformers
    generates for it alone."""
    hf, path = hf_model(make_hf_model, case, vocab_size=VOCAB)
    add_tokenizer(path)
    model, _ = load_model(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12, 1)]
    eos = 5
    batched = [r.tokens for r in generate(model, load_tokenizer(path), prompts,
                                          GenerateConfig(max_new_tokens=10, eos_token_ids=[eos]))]
    assert batched == [hf_greedy(hf, [p], 10, eos)[0] for p in prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_and_config_round_trip_bit_exact(case, make_hf_model, tmp_path):
    _, path = hf_model(make_hf_model, case)
    saved = save_hf_model(load_hf_model(path), tmp_path / "out")
    original, written = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert written["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert json.loads((saved / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_a_training_checkpoint_converted_and_exported_keeps_every_tensor_bit_exact(make_hf_model, tmp_path):
    """convert (Hugging Face -> training checkpoint) then export: the correction biases too."""
    from llmflow.weights.convert import ConvertConfig, convert
    from llmflow.weights.export import ExportConfig, export

    _, path = hf_model(make_hf_model, "air")
    add_tokenizer(path)
    out = export(ExportConfig(ckpt=convert(ConvertConfig(hf=path, out=tmp_path / "ckpt")), out=tmp_path / "hf"))
    original, written = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(written) == sorted(original) and "model.layers.2.mlp.gate.e_score_correction_bias" in written
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name


def test_the_multi_token_prediction_layer_is_left_out(make_hf_model, tokens, tmp_path, caplog):
    """The Hub's checkpoints hold it as layer num_hidden_layers: left out, said in one line."""
    hf, path = hf_model(make_hf_model, "air")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.3.mlp.gate.e_score_correction_bias"] = torch.zeros(8)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids = tokens(1, 12)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        assert_close(load_hf_model(tmp_path)(ids), hf(ids).logits)
    assert "left out 2 tensors of the multi-token prediction layer (model.layers.3.*)" in caplog.text


@pytest.mark.parametrize("change, problem", [
    ({"n_group": 3}, "n_group=3 must split n_routed_experts=8 into equal groups of at least 2 experts"),
    ({"topk_group": 5}, "topk_group=5; expected 1 to n_group=4"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5; the topk_group=2 groups kept hold 4 experts"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported; llmflow routes with scoring_func='sigmoid'"),
    ({"n_shared_experts": -1}, "n_shared_experts=-1; expected a count of 0 or more"),
])
def test_config_keys_the_router_cannot_express_are_refused(make_hf_model, change, problem):
    _, path = make_hf_model("glm4_moe", **CASES["air"])
    config = {**json.loads((path / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match="^config.json: " + problem.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(config)


def test_keys_config_json_leaves_out_take_transformers_defaults(make_hf_model):
    _, path = make_hf_model("glm4_moe", **{**CASES["air"], "n_shared_experts": 0, "first_k_dense_replace": 2})
    config = ModelConfig.from_file(path)
    assert config.dense_layers == (0, 1) and config.shared_expert_intermediate_size == 0
    hf = json.loads((path / "config.json").read_text())
    for key in ("rms_norm_eps", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
                "first_k_dense_replace", "norm_topk_prob"):
        del hf[key]
    del hf["rope_parameters"]["partial_rotary_factor"]
    config = ModelConfig.from_hf(hf)  # Glm4MoeConfig's defaults
    assert config.partial_rotary_factor == 0.5 and config.rms_norm_eps == 1e-5 and config.norm_topk_prob
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (1, 1, 1.0)
    assert config.dense_layers == (0,) and config.shared_expert_intermediate_size == 32


@pytest.fixture
def one_process_group(tmp_path):
    """A process group of this process alone (gloo), for megatron-core's collectives."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bias_update_is_megatron_cores(one_process_group, monkeypatch):
    """``corrected_bias`` against megatron-core 0.16.1's ``get_updated_expert_bias`` (its
    all-reduce over the tensor-, context- and data-parallel group here over this one process):
    equal on loads with ties, zero loads and a balanced layer."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    monkeypatch.setattr(parallel_state, "get_tensor_and_data_parallel_group", lambda **_: dist.group.WORLD)
    loads = torch.tensor([[5.0, 0.0, 12.0, 7.0, 7.0, 1.0, 0.0, 8.0], [5.0] * 8, [40.0, 0, 0, 0, 0, 0, 0, 0]])
    bias = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    expected = get_updated_expert_bias(loads.clone(), bias, 1e-3)
    assert torch.equal(corrected_bias(bias, loads.long(), 1e-3), expected)
    assert torch.equal(expected[1], bias[1])


def test_sequence_wise_loss_is_megatron_cores():
    """``sequence_balancing_loss`` of two MoE layers against megatron-core 0.16.1's
    ``seq_aux_loss`` (``TopKRouter._apply_seq_aux_loss``: ``switch_load_balancing_loss_func``
    over the [seq_length, batch x experts] view of the scores and of their top-k map, divided
    by the batch size; coefficient 1), summed over the layers; its gradient reaches the
    probabilities."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    g = torch.Generator().manual_seed(4)
    sequences, length, experts, top_k = 3, 10, 8, 3
    blocks, expected = [], 0.0
    for _ in range(2):
        block = MoE(16, 8, experts, top_k, True)
        scores = torch.rand(sequences * length, experts, generator=g)
        probabilities = (scores / scores.sum(-1, keepdim=True)).requires_grad_()
        block.routing = Routing(torch.zeros(experts), probabilities.sum(0), sequences * length, top_k, sequences,
                                probabilities)
        blocks.append(block)
        # megatron's tokens are sequence-major: [seq_length, batch, experts].
        theirs = probabilities.detach().view(sequences, length, experts).transpose(0, 1)
        routing_map = torch.zeros_like(theirs, dtype=torch.bool).scatter(2, theirs.topk(top_k, dim=2).indices, True)
        theirs, routing_map = theirs.reshape(length, -1), routing_map.reshape(length, -1)
        expected = expected + switch_load_balancing_loss_func(
            theirs, routing_map.sum(dim=0), length, top_k, experts, 1.0) / sequences
    loss = sequence_balancing_loss(blocks)
    assert_close(loss, expected, atol=1e-6)
    loss.backward()
    assert blocks[0].routing.probabilities.grad.abs().sum() > 0


# --- training: the bias update and the sequence-wise loss at ep=2 as in one process ---------------

BIAS_RATE, SEQ_COEF = 0.01, 0.01
TRAIN_TOLERANCES = {"loss": 1e-5, "grad_norm": 1e-4, "moe_aux_loss": 1e-5, "moe_seq_aux_loss": 1e-5,
                    "max_expert_load": 0.01}


@pytest.fixture(scope="module")
def glm_assets(sample_assets, tmp_path_factory, make_hf_model):
    """The sample data tokenized, and the tiny GLM-4.5-Air-shaped model (random nonzero
    correction biases) with the sample's vocabulary and tokenizer."""
    from train_helpers import training_assets

    from llmflow.weights.tokenizer_files import copy_tokenizer_files

    assets = training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("glm"))
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    _, path = hf_model(make_hf_model, "air", vocab_size=vocab)
    copy_tokenizer_files(assets["model"], path)
    return {**assets, "model": path}


def train_glm(assets, out, nproc=1, **overrides) -> dict[int, dict[str, float]]:
    """The compared metrics of every step line of a run of ``overrides``, by step."""
    from forked_workers import train_forked
    from train_helpers import config, step_metrics

    lines = train_forked(config(assets, out, **{"steps": 4, **overrides}), nproc, env={"OMP_NUM_THREADS": "1"})
    return step_metrics(lines, TRAIN_TOLERANCES)


def correction_biases(out) -> torch.Tensor:
    """Every MoE layer's correction bias in the run's latest checkpoint."""
    model, _ = load_model(out)
    return torch.stack([layer.mlp.gate.e_score_correction_bias for layer in list(model.model.layers.values())[1:]])


@pytest.mark.slow
def test_expert_parallel_ranks_update_the_biases_and_train_the_sequence_loss_of_one_process(glm_assets, tmp_path):
    """ep=2 (two ranks, each holding half the experts, each routing half of every micro-batch)
    with the auxiliary-loss-free bias update and the sequence-wise loss on: losses, gradient
    norms, both auxiliary losses and the experts' load equal one process's, and so do the
    biases saved at the end, which moved; without the update the later steps differ."""
    options = {"router_bias_update_rate": BIAS_RATE, "router_seq_aux_loss_coef": SEQ_COEF, "save_interval": 4}
    one = train_glm(glm_assets, tmp_path / "one", micro_batch_size=4, **options)
    ep = train_glm(glm_assets, tmp_path / "ep", nproc=2, dp=2, ep=2, micro_batch_size=2, **options)
    assert sorted(one) == sorted(ep) == [1, 2, 3, 4]
    for step, metrics in ep.items():
        assert metrics.keys() == one[step].keys() and "moe_seq_aux_loss" in metrics, (step, metrics)
        for key, value in metrics.items():
            assert abs(value - one[step][key]) <= TRAIN_TOLERANCES[key], (step, key, ep, one)
    initial = correction_biases(glm_assets["model"])
    trained = correction_biases(tmp_path / "one")
    assert torch.equal(correction_biases(tmp_path / "ep"), trained)
    moves = (trained - initial).abs() / BIAS_RATE
    assert moves.max() > 0 and torch.allclose(moves, moves.round(), atol=1e-3) and moves.max() <= 4 + 1e-3
    fixed = train_glm(glm_assets, tmp_path / "fixed", micro_batch_size=4,
                      **{**options, "router_bias_update_rate": 0.0})
    assert fixed[1]["loss"] == one[1]["loss"] and any(abs(fixed[s]["loss"] - one[s]["loss"]) > 1e-6 for s in (2, 3, 4))


def test_routing_options_a_model_or_layout_cannot_take_are_refused(make_hf_model, tmp_path):
    from train_helpers import config

    from llmflow.train.preflight import routing_option_problems
    from llmflow.weights.megatron.layout import unmapped_layers

    _, glm = make_hf_model("glm4_moe", **CASES["air"])
    _, qwen = make_hf_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assets = {"model": str(glm), "wiki": str(tmp_path)}
    on = {"router_bias_update_rate": 1e-3, "router_seq_aux_loss_coef": 1e-4}
    glm_config, qwen_config = ModelConfig.from_file(glm), ModelConfig.from_file(qwen)
    assert routing_option_problems(config(assets, tmp_path / "run", **on), glm_config) == []
    assert routing_option_problems(config(assets, tmp_path / "run", **on), qwen_config) == [
        ("router_bias_update_rate=0.001: qwen3_moe has no router correction bias (e_score_correction_bias) to update; "
         "set it to 0")]
    assert routing_option_problems(config(assets, tmp_path / "run", pp=2, **on), glm_config) == [
        "router_bias_update_rate=0.001 is not supported under pp=2; set it to 0, or pp=1",
        "router_seq_aux_loss_coef=0.0001 is not supported under pp=2; set it to 0, or pp=1"]
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}
    assert routing_option_problems(config(assets, tmp_path / "run", lora=lora, **on), glm_config) == [
        ("router_bias_update_rate=0.001 with lora: a LoRA checkpoint stores only the adapters, not the updated "
         "biases; set it to 0")]
    assert "sigmoid router" in unmapped_layers(glm_config) and unmapped_layers(qwen_config) is None
