"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers on tiny
random weights (fp32): logits, the load-balancing auxiliary loss, the checkpoint round trip,
and the grouped matmul of the experts against its per-expert reference."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import llmflow.kernels as K
from llmflow.models import ConfigError, ModelConfig
from llmflow.models.blocks.moe import MoE, load_balancing_loss, moe_layers
from llmflow.weights import CheckpointError, load_hf_model, save_hf_model

ATOL = 1e-5
AUX_ATOL = 1e-6
BATCH, SEQ = 2, 40

# Shaped like the published configs, shrunk: GQA, several experts, top-2 routing.
MOE_CASES = {
    "qwen3_moe": ("qwen3_moe", {"num_key_value_heads": 2, "head_dim": 24, "num_experts": 6, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen3_moe_tied_dense_layer": ("qwen3_moe", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                 "mlp_only_layers": [1], "tie_word_embeddings": True}),
    "qwen2_moe": ("qwen2_moe", {"num_key_value_heads": 2, "num_experts": 6, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    "qwen2_moe_sparse_step": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                            "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2,
                                            "norm_topk_prob": True, "tie_word_embeddings": True}),
    "mixtral": ("mixtral", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
}


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_logits_and_auxiliary_loss_match_transformers(case, make_hf_model, tokens):
    family, overrides = MOE_CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path).eval()
    assert ours.config.model_type == family
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        expected = hf(ids, output_router_logits=True)
        got = ours(ids)
    assert_close(got, expected.logits)
    aux = load_balancing_loss(block for _, block in moe_layers(ours))
    assert_close(aux, expected.aux_loss, atol=AUX_ATOL)
    # The layers transformers builds sparse are the ones we route, and no others.
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    ours_sparse = [int(name) for name, layer in ours.model.layers.items() if isinstance(layer.mlp, MoE)]
    assert ours_sparse == hf_sparse and hf_sparse


def test_auxiliary_loss_gradients_reach_the_router(make_hf_model, tokens):
    _, path = make_hf_model("qwen3_moe", **MOE_CASES["qwen3_moe"][1])
    model = load_hf_model(path)
    model(tokens(BATCH, SEQ))
    load_balancing_loss(block for _, block in moe_layers(model)).backward()
    router = model.model.layers["0"].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_checkpoint_round_trip_is_bit_exact_in_the_hub_names(case, make_hf_model, tmp_path):
    family, overrides = MOE_CASES[case]
    _, path = make_hf_model(family, **overrides)
    saved = save_hf_model(load_hf_model(path), tmp_path / "out")
    original, written = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in written


def test_a_checkpoint_with_fewer_experts_than_its_config_is_refused(make_hf_model):
    _, path = make_hf_model("qwen3_moe", **MOE_CASES["qwen3_moe"][1])
    config = (path / "config.json").read_text().replace('"num_local_experts": 6', '"num_local_experts": 8')
    (path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate\.weight' has shape \(6, 64\), "
                                              r"config\.json implies \(8, 64\)"):
        load_hf_model(path)


def test_a_checkpoint_with_more_experts_than_its_config_is_refused(make_hf_model):
    _, path = make_hf_model("qwen3_moe", **MOE_CASES["qwen3_moe"][1])
    config = (path / "config.json").read_text().replace('"num_local_experts": 6', '"num_local_experts": 4')
    (path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.4\.\w+\.weight' has no place in a "
                                              r"qwen3_moe model of num_experts=4"):
        load_hf_model(path)


@pytest.mark.parametrize("hf, message", [
    ({"num_experts": 0}, r"num_experts=0; a mixture of experts needs a positive expert count"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, r"num_experts_per_tok=5; expected 1 to num_experts=4"),
])
def test_bad_expert_counts_are_one_line_errors(hf, message):
    base = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**base, **hf})


@pytest.mark.parametrize("rows", [[5, 0, 11, 8], [0, 0, 24, 0]])
@pytest.mark.parametrize("width", [64, 6])  # 6 fp32 columns: strides F.grouped_mm does not take
def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward(rows, width):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(rows), width, generator=g, requires_grad=True)
    weight = torch.randn(len(rows), 32, width, generator=g, requires_grad=True)
    counts = torch.tensor(rows)
    upstream = torch.randn(sum(rows), 32, generator=g)
    grads = []
    for kernels in (K.FUSED, K.REFERENCE):
        with K.use_kernels(kernels):
            out = K.grouped_mm(x, weight, counts)
        out.backward(upstream)
        grads.append((out.detach(), x.grad.clone(), weight.grad.clone()))
        x.grad = weight.grad = None
    for fused, reference in zip(*grads, strict=True):
        assert_close(fused, reference)


def test_random_initialisation_covers_routers_and_experts():
    """``init_weights`` (convert --init random, pretraining from scratch) draws the routers'
    and the stacked experts' weights like every other matrix."""
    from llmflow.models import CausalLM

    config = ModelConfig.from_hf({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                                  "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 64})
    with torch.device("meta"):
        model = CausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    for name, block in moe_layers(model):
        for weight in (block.gate.weight, block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj):
            assert torch.isfinite(weight).all() and abs(weight.std().item() - 0.02) < 0.002, name


def test_the_moe_block_compiles_in_fp32_as_one_graph_with_eager_results():
    """torch.compile traces F.grouped_mm in bfloat16 only: in fp32 the fused kernel runs as an
    opaque op, and the block (counts, permutation, experts, combine) compiles without a
    graph break to the eager block's output, gradients and routing counts."""
    torch.manual_seed(0)
    block = MoE(64, 32, num_experts=4, top_k=2, norm_topk_prob=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 24, 64)
    upstream = torch.randn(2, 24, 64)
    results = []
    for forward in (block, torch.compile(block, fullgraph=True)):
        with K.use_kernels(K.FUSED):
            xx = x.clone().requires_grad_()
            out = forward(xx)
        out.backward(upstream)
        results.append((out.detach(), xx.grad, block.experts.down_proj.grad.clone(), block.gate.weight.grad.clone(),
                        block.routing.tokens_per_expert))
        block.zero_grad(set_to_none=True)
    for compiled, eager in zip(*reversed(results), strict=True):
        assert_close(compiled, eager)
    torch.library.opcheck(torch.ops.llmflow.grouped_mm.default,
                          (torch.randn(24, 64, requires_grad=True), torch.randn(4, 32, 64, requires_grad=True),
                           torch.tensor([5, 5, 16, 24], dtype=torch.int32)))


def test_flops_per_token_count_the_experts_a_token_goes_through():
    """MFU's FLOPs of a mixture of experts: a token computes with the router and its top-k
    experts, as a dense model of k experts' width would, plus the router."""
    from llmflow.train.metrics import flops_per_token

    shape = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16}
    moe = ModelConfig.from_hf({"model_type": "qwen3_moe", **shape, "intermediate_size": 48, "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": [1]})
    dense = ModelConfig.from_hf({"model_type": "qwen3", **shape, "intermediate_size": 48})
    narrow = ModelConfig.from_hf({"model_type": "qwen3", **shape, "intermediate_size": 2 * 24})
    router = 6 * 8 * 32
    # Layers 0 and 2 route (two experts of 24 = one SwiGLU of 48, and the router); layer 1 is dense.
    assert flops_per_token(moe, 128) == flops_per_token(narrow, 128) + 2 * router == flops_per_token(dense, 128) + 2 * router
