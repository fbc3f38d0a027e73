"""gpt-oss (``gpt_oss``) against transformers' GptOssForCausalLM on tiny random weights (fp32,
eager attention): sliding-window layers with a window shorter than the test sequences between
full ones, GQA, YaRN rotary, nonzero attention sinks and biases, 4 experts top-2 with a swiglu
limit low enough to clamp. Logits on the fused and reference kernels, the sink attention
kernels against each other, the loss and every gradient (the sinks' among them), greedy
generation, the checkpoint and config round trip, an MXFP4 checkpoint, and the config keys
llmflow refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_generate import VOCAB, add_tokenizer, hf_greedy
from test_quantized_checkpoints import mxfp4_quantize

import llmflow.kernels as K
from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer.generate import GenerateConfig, generate
from llmflow.kernels import fused, reference
from llmflow.models import ConfigError, ModelConfig
from llmflow.weights import load_hf_model, load_model, save_hf_model
from llmflow.weights.hf_names import hf_names

ATOL = 1e-5
BATCH, SEQ = 2, 24
WINDOW = 5
LIMIT = 0.3
"""swiglu_limit: low enough that random tiny weights reach it (the published 7.0 would not)."""
GPT_OSS = {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": WINDOW, "swiglu_limit": LIMIT,
           "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}}


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def hf_model(make_hf_model, **extra):
    return make_hf_model("gpt_oss", **{**GPT_OSS, **extra})


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[0, :4] = -100
    return labels


@pytest.mark.parametrize("kernels", [K.FUSED, K.REFERENCE], ids=["fused", "reference"])
def test_logits_match_transformers(kernels, make_hf_model, tokens):
    hf, path = hf_model(make_hf_model)
    ours = load_hf_model(path).eval()
    ids = tokens(BATCH, SEQ)
    with torch.no_grad(), K.use_kernels(kernels):
        got, expected = ours(ids), hf(ids).logits
    print(f"{kernels.name}: largest logit difference {(got - expected).abs().max():.1e}")
    assert_close(got, expected)
    layers = list(ours.model.layers.values())
    assert [layer.self_attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW]
    assert torch.equal(ours.model.inv_freq, hf.model.rotary_emb.inv_freq)
    assert ours.model.rotary_scale == hf.model.rotary_emb.attention_scaling != 1.0
    assert all(layer.self_attn.sinks.abs().min() > 0 for layer in layers)
    with torch.no_grad():  # the clamp is reached: the limit matters
        x = hf.model.layers[0].post_attention_layernorm(hf.model.embed_tokens(ids)).flatten(0, 1)
        experts = hf.model.layers[0].mlp.experts
        assert (x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]).abs().max() > LIMIT


@pytest.mark.parametrize("q_len, window, documents", [(12, None, False), (12, 4, False), (1, 4, False),
                                                      (3, None, False), (12, None, True)])
def test_sink_attention_fused_matches_reference(q_len, window, documents):
    """The fused path (SDPA with a zero key biased by the sink) against the reference's
    explicit softmax with the sink column: outputs and the gradients of q, k, v and the sinks."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 8, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    document_ids = torch.tensor([[0] * 5 + [1] * 7] * 2) if documents else None
    results = []
    for attention in (reference.attention, fused.attention):
        out = attention(q, k, v, 0.3, document_ids, window, sinks=sinks)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, sinks))))
    for got, expected in zip(results[1], results[0], strict=True):
        assert_close(got, expected, atol=1e-5)


def test_loss_and_gradients_match_transformers(make_hf_model, tokens):
    """The fused and reference losses against cross-entropy on transformers' logits, and the
    gradient of every parameter (the sinks', router's and experts' biases among them) against
    transformers' autograd."""
    hf, path = hf_model(make_hf_model)
    ours = load_hf_model(path)
    ids = tokens(BATCH, SEQ)
    labels = _labels(ids)
    hf.train()  # dropout is 0
    expected = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    hf_params = dict(hf.named_parameters())
    for kernels in (K.FUSED, K.REFERENCE):
        ours.zero_grad(set_to_none=True)
        with K.use_kernels(kernels):
            loss = ours(ids, labels=labels)
        loss.backward()
        assert_close(loss.detach(), expected.detach())
        largest = 0.0
        for name, param in ours.named_parameters():
            theirs = hf_params[hf_names(name, ours.config)[0]].grad
            assert param.grad is not None and param.grad.abs().max() > 0, name
            assert_close(param.grad, theirs)
            largest = max(largest, (param.grad - theirs).abs().max().item())
        print(f"{kernels.name}: loss difference {(loss - expected).abs():.1e}, largest gradient difference "
              f"{largest:.1e}")
        sinks = ours.model.layers["0"].self_attn.sinks.grad
        assert_close(sinks, hf.model.layers[0].self_attn.sinks.grad)


def test_greedy_generation_matches_transformers(make_hf_model, static_generate):
    """Left-padded prompts of 7, 3, 12 and 1 tokens and 10 new tokens, longer than the window:
    each row generates what transformers generates for it alone, and what llmflow generates for
    it alone, over the growing KV cache and over the compiled step's static one."""
    hf, path = hf_model(make_hf_model, vocab_size=VOCAB)
    add_tokenizer(path)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12, 1)]
    eos = 5
    config = GenerateConfig(max_new_tokens=10, eos_token_ids=[eos])
    batched = [r.tokens for r in generate(model, tokenizer, prompts, config)]
    alone = [hf_greedy(hf, [p], 10, eos)[0] for p in prompts]
    assert batched == alone
    assert batched == [generate(model, tokenizer, [p], config)[0].tokens for p in prompts]
    assert static_generate(model, tokenizer, prompts, config) == batched


def test_checkpoint_and_config_round_trip_bit_exact(make_hf_model, tokens, tmp_path):
    """Every tensor under transformers' names (``mlp.router``, ``mlp.experts.gate_up_proj``
    [E, hidden, 2 inter] interleaved, its bias, ``down_proj`` [E, inter, hidden]) and config.json
    written back as they were; transformers loads the export to the same logits."""
    from transformers import AutoModelForCausalLM

    hf, path = hf_model(make_hf_model)
    saved = save_hf_model(load_hf_model(path), tmp_path / "out")
    original, written = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((saved / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def quantize_experts_mxfp4(source: Path, target: Path) -> None:
    """The gpt-oss checkpoint in ``source`` written to ``target`` (``source`` itself to rewrite it)
    with its experts as MXFP4 blocks and scales, as the Hub's checkpoints hold them."""
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_matches_transformers_dequantized(make_hf_model, tokens, tmp_path):
    """The tiny model's experts quantized to MXFP4 as gpt-oss stores them (``_blocks``,
    ``_scales``): llmflow's logits are those of transformers' Mxfp4Config(dequantize=True) model."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    hf, path = hf_model(make_hf_model)
    directory = tmp_path / "mxfp4"
    directory.mkdir()
    quantize_experts_mxfp4(path, directory)
    theirs = GptOssForCausalLM.from_pretrained(directory, quantization_config=Mxfp4Config(dequantize=True),
                                               attn_implementation="eager").eval()
    ours = load_hf_model(directory).eval()
    assert ours.model.layers["0"].mlp.experts.gate_up_weight.dtype == theirs.model.layers[0].mlp.experts.gate_up_proj.dtype
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        got, expected = ours(ids).float(), theirs(ids).logits.float()
        dequantized = ours.model.layers["1"].mlp.experts.down_weight
        assert not torch.equal(dequantized.float(), hf.model.layers[1].mlp.experts.down_proj)  # really quantized
    print(f"mxfp4: largest logit difference {(got - expected).abs().max():.1e}")
    assert_close(got, expected)


@pytest.mark.parametrize("override, key", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"swiglu_limit": "7"}, "swiglu_limit"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_refused_config_keys(make_hf_model, override, key):
    _, path = hf_model(make_hf_model)
    config = {**json.loads((path / "config.json").read_text()), **override}
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf(config)
