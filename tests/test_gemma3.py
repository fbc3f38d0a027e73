"""Gemma 3's text decoder (``gemma3_text``) against transformers' Gemma3ForCausalLM on tiny
random weights (fp32, eager attention), shaped like the published configs: local layers
attending within a window shorter than the test sequences and global layers of another
rotary base (linear scaling, as Gemma 3 4B-27B), GQA and MQA, tied (the default) and untied
embeddings, with and without the final-logit soft cap. Logits, packed documents, the fused
and reference losses and every gradient, greedy generation, the checkpoint and config round
trips, transformers 4's config spelling, bf16's rounded embedding scale, LoRA against PEFT, the
tensor-parallel plan, generation at tp=2 and tp=2 and pp=2 training against one process, the
memory plan, and the config keys llmflow refuses.

Run as a script (``layers``), this file measures what a Gemma 3 layer keeps for backward, as
tests/test_memory_plan.py measures the other families'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_generate import VOCAB, add_tokenizer, hf_greedy

import llmflow.kernels as K
from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer.generate import GenerateConfig, generate
from llmflow.models import CausalLM, ConfigError, LoraConfig, ModelConfig, apply_lora
from llmflow.train.memory import layer_activation_bytes, layer_params, model_params
from llmflow.weights import load_hf_model, load_model, save_hf_model
from llmflow.weights.hf import hf_config_dict
from llmflow.weights.megatron.layout import unmapped_layers

ATOL = 1e-5
BATCH, SEQ = 2, 24
WINDOW = 5
# hidden 72: sqrt(72) = 8.485 is no power of two, so the embedding scale rounds in bf16 (to 8.5).
# Layers 0 and 2 attend within 5 positions (rotary base 10,000), layers 1 and 3 to the whole
# prefix (base 1e6, linear scaling by 8): sliding_window_pattern 2.
GEMMA = {"hidden_size": 72, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
CASES = {
    "gemma3": GEMMA,  # tied embeddings (Gemma's default), no soft cap (as the published configs)
    "gemma3_softcap_untied": {**GEMMA, "num_hidden_layers": 3, "num_key_value_heads": 1, "attention_bias": True,
                              "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                              "final_logit_softcapping": 3.0, "tie_word_embeddings": False},
}
SOFTCAP = "gemma3_softcap_untied"


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def hf_model(make_hf_model, case, **extra):
    return make_hf_model("gemma3_text", **{**CASES[case], **extra})


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, make_hf_model, tokens):
    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path).eval()
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        got, expected = ours(ids), hf(ids).logits
        print(f"{case}: largest logit difference {(got - expected).abs().max():.1e}")
        assert_close(got, expected)
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers.values()]
    assert windows == [WINDOW if t == "sliding_attention" else None for t in hf.config.layer_types]
    rotary = hf.model.rotary_emb
    assert torch.equal(ours.model.inv_freq, rotary.full_attention_inv_freq)
    assert torch.equal(ours.model.sliding_inv_freq, rotary.sliding_attention_inv_freq)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    if case == SOFTCAP:  # the cap matters: without it the logits differ
        with torch.no_grad():
            assert (ours.lm_head(ours.model(ids)) - got).abs().max() > 0.1


def test_packed_documents_equal_separate_documents(make_hf_model, tokens):
    """Documents longer than the window, positions restarting in each: every document's logits
    are transformers' for it alone."""
    hf, path = hf_model(make_hf_model, "gemma3")
    ours = load_hf_model(path).eval()
    docs = torch.tensor([[0] * 9 + [1] * 7 + [2] * 4, [5] * 3 + [7] * 11 + [9] * 6])
    ids = tokens(2, docs.shape[1], seed=3)
    checked = 0
    with torch.no_grad():
        packed = ours(ids, document_ids=docs)
        for b in range(2):
            for d in docs[b].unique():
                idx = (docs[b] == d).nonzero().squeeze(1)
                assert_close(packed[b : b + 1, idx], hf(ids[b : b + 1, idx]).logits)
                checked += 1
        assert checked == 6
        assert (ours(ids)[0, 9:] - packed[0, 9:]).abs().max() > 1e-3


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[0, :4] = -100
    return labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_match_transformers(case, make_hf_model, tokens):
    """The fused (chunked) and reference losses, every reduction, a temperature, the per-token
    entropy and the gradient of every parameter, against cross-entropy on transformers' logits;
    token 0 (``pad_token_id``) among the inputs, its embedding row getting no gradient from the
    lookup as in transformers' nn.Embedding(padding_idx=0)."""
    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path)
    ids = tokens(BATCH, SEQ)
    ids[:, 3] = 0
    labels = _labels(ids)
    rows, targets = labels != -100, labels[labels != -100]
    hf.train()  # dropout is 0; train() only so transformers tracks grads the usual way
    logits = hf(ids).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    hf_grads = dict(hf.named_parameters())
    with torch.no_grad():
        tokens_loss = F.cross_entropy(logits[rows], targets, reduction="none")
        log_probs = logits[rows].log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        hot = F.cross_entropy(logits.flatten(0, 1) / 0.7, labels.flatten(), ignore_index=-100)
    for kernels in (K.FUSED, K.REFERENCE):
        ours.zero_grad(set_to_none=True)
        with K.use_kernels(kernels):
            loss = ours(ids, labels=labels)
            loss.backward()
            assert_close(loss.detach(), expected.detach())
            with torch.no_grad():
                every, ent = ours(ids, labels=labels, loss_reduction="none", return_entropy=True)
                assert_close(every[rows], tokens_loss)
                assert_close(ent[rows], entropy)
                assert_close(ours(ids, labels=labels, loss_reduction="sum"), tokens_loss.sum(), atol=ATOL * rows.sum())
                assert_close(ours(ids, labels=labels, temperature=0.7), hot)
        for name, grad in _grads(ours).items():
            assert_close(grad, hf_grads[name].grad)
    embedding = ours.get_parameter("model.embed_tokens.weight")
    if not hf.config.tie_word_embeddings:  # only the lookup reaches it: nothing for the pad row
        assert torch.equal(embedding.grad[0], torch.zeros_like(embedding.grad[0]))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers(case, make_hf_model, static_generate):
    """Left-padded prompts of 7, 3, 12 and 1 tokens and 10 new tokens, longer than the window:
    each row generates what transformers generates for it alone, and what llmflow generates for
    it alone, over the growing KV cache and over the compiled step's static one."""
    hf, path = hf_model(make_hf_model, case, vocab_size=VOCAB)
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


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_and_config_round_trip_bit_exact(case, make_hf_model, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, path = hf_model(make_hf_model, case)
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


def test_transformers4_config_spelling_is_read(make_hf_model, tokens):
    """Gemma 3 as its Hub config.json spells it (transformers 4.50): rope_theta,
    rope_local_base_freq and rope_scaling at the top level, the layers from
    sliding_window_pattern, no layer_types."""
    hf, path = hf_model(make_hf_model, "gemma3")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    full = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    cfg.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling=full,
               rope_local_base_freq=rope["sliding_attention"]["rope_theta"], torch_dtype=cfg.pop("dtype"))
    (path / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_file(path)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert (config.rope_theta, config.sliding_rope_theta, config.rope_scaling) == (1e6, 1e4, full)
    assert hf_config_dict(config) == {**cfg, "architectures": ["Gemma3ForCausalLM"]}
    ids = tokens(1, 12)
    with torch.no_grad():
        assert_close(load_hf_model(path)(ids), hf(ids).logits)


def test_defaults_are_gemma3s():
    """A config.json naming only the shape reads Gemma3TextConfig's defaults, not the other
    families' (tied embeddings, head_dim 256, window 4096 on five layers of six, rotary bases 1e6
    and 1e4, query_pre_attn_scalar 256)."""
    config = ModelConfig.from_hf({"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 8})
    assert config.tie_word_embeddings and config.head_dim == 256 and config.num_key_value_heads == 4
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert [config.layer_window(i) for i in (0, 5)] == [4096, None]
    assert (config.rope_theta, config.rope_scaling, config.sliding_rope_theta) == (1e6, None, 1e4)
    assert config.attention_scale == 256**-0.5 and config.embedding_scale == 8.0
    assert (config.embedding_padding_idx, config.bos_token_id, config.eos_token_id) == (0, 2, 1)
    assert config.final_logit_softcapping is None and config.max_position_embeddings == 131_072


SHAPE = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 2}


@pytest.mark.parametrize("changes, key", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention", "linear_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                          "sliding_attention": {"rope_type": "default"}}}, "rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding_attention.rope_type"),
])
def test_config_keys_llmflow_cannot_compute_are_refused(changes, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf({**SHAPE, **changes}, source="config.json")


def test_bf16_embedding_scale_is_rounded_as_transformers(make_hf_model, tokens):
    hf, path = hf_model(make_hf_model, "gemma3")
    ours = load_hf_model(path, dtype=torch.bfloat16)
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        got, expected = ours.model.embed_tokens(ids), hf.to(torch.bfloat16).model.embed_tokens(ids)
    assert torch.equal(got, expected)
    assert not torch.equal(got, ours.model.embed_tokens.weight[ids] * 72**0.5)  # 8.5, not 8.485


def test_lora_forward_matches_peft(make_hf_model, tokens):
    """LoRA's default targets on attention and the GeGLU MLP: the adapters under Hugging Face's
    module names, the base frozen, the logits PEFT's on transformers' model with the same
    adapter weights."""
    import peft

    hf, path = hf_model(make_hf_model, "gemma3")
    ours = load_hf_model(path).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = apply_lora(ours, LoraConfig(rank=4, alpha=8.0, target_modules=targets))
    assert len(adapted) == 7 * 4
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        n for n, _ in ours.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    hf_peft = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets)).eval()
    theirs = dict(hf_peft.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                theirs[f"base_model.model.{name.replace('.weight', '.default.weight')}"].copy_(p)
        ids = tokens(BATCH, SEQ)
        assert_close(ours(ids), hf_peft(ids).logits)


def test_tensor_parallel_plan_keeps_the_four_norms_whole():
    """On torch's fake process group of two ranks: q/k/v and gate/up split by rows, o/down by
    columns, all four layer norms, the q/k norms and the final norm whole; a step runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmflow.models.parallelize import parallelize_decoder

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
        model = CausalLM(ModelConfig.from_hf({**SHAPE, "head_dim": 16, "num_key_value_heads": 2,
                                               "sliding_window": 4, "sliding_window_pattern": 2}))
        parallelize_decoder(model, mesh)
        laid_out = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
        assert len(laid_out) == len(list(model.parameters()))
        layer = "model.layers.1."
        assert laid_out[layer + "self_attn.q_proj.weight"] == laid_out[layer + "mlp.up_proj.weight"] == (Shard(0),)
        assert laid_out[layer + "self_attn.o_proj.weight"] == laid_out[layer + "mlp.down_proj.weight"] == (Shard(1),)
        norms = [name for name in laid_out if name.endswith("norm.weight")]
        assert len(norms) == 6 * 2 + 1 and all(laid_out[name] == (Replicate(),) for name in norms)
        ids = torch.randint(0, 64, (2, 8))
        model(ids, labels=ids, position_ids=torch.arange(8).expand(2, 8)).backward()
    finally:
        dist.destroy_process_group()


def test_megatron_layout_refuses_the_sandwich_norms():
    reason = unmapped_layers(ModelConfig.from_hf(SHAPE))
    assert "post_feedforward_layernorm" in reason


# --- training at tp=2 and pp=2 ---------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def training(sample_assets, tmp_path_factory, make_hf_model):
    """The sample data tokenized, a tiny Gemma 3 over its vocabulary (window 8 on rows of 64
    tokens, packed documents) and one process's losses."""
    from train_helpers import config, train_in_subprocess, training_assets

    from llmflow.weights.tokenizer_files import copy_tokenizer_files

    assets = training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("gemma3"))
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    _, path = make_hf_model("gemma3_text", vocab_size=vocab, **{**GEMMA, "sliding_window": 8})
    copy_tokenizer_files(assets["model"], path)

    def settings(out, **overrides):
        data = {"kind": "pretrain", "document_attention": True, "paths": [str(assets["wiki"])]}
        return config(assets, out, model=str(path), steps=STEPS, data=data, **overrides)

    root = tmp_path_factory.mktemp("gemma3-runs")
    return settings, root, train_in_subprocess(settings(root / "one"))


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc", [({"tp": 2}, 2), ({"pp": 2}, 2)], ids=["tp2", "pp2"])
def test_loss_matches_one_process(training, tmp_path, layout, nproc):
    """tp=2: the four norms of each layer on sequence shards (the post-norms on o_proj's and
    down_proj's reduce-scattered outputs); pp=2: layers 0-1 and 2-3 on two stages, each with both
    rotary tables."""
    from train_helpers import assert_close as losses_close
    from train_helpers import run

    settings, _, reference = training
    got = run(settings(tmp_path / "run", **layout), nproc)
    assert sorted(got) == list(range(1, STEPS + 1))
    print(f"{layout}: largest loss difference {max(abs(got[s] - reference[s]) for s in got):.1e}")
    losses_close(got, reference)


# --- the memory plan ---------------------------------------------------------------------------


def memory_config(**changes) -> ModelConfig:
    """A Gemma 3 shaped like test_memory_plan.qwen2() (hidden 512, 8 heads of 64, 2 KV heads),
    every layer local with a window of 64."""
    layers = changes.pop("num_hidden_layers", 2)
    values = {"model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1536,
              "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
              "sliding_window": 64, "layer_types": ["sliding_attention"] * layers, "query_pre_attn_scalar": 64}
    return ModelConfig.from_hf({**values, **changes})


@pytest.mark.parametrize("case", list(CASES))
def test_memory_plan_counts_every_parameter(case, make_hf_model):
    hf, path = hf_model(make_hf_model, case)
    config = ModelConfig.from_file(path)
    with torch.device("meta"):
        model = CausalLM(config)
    assert model_params(config) == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    for i, layer in model.model.layers.items():
        assert layer_params(config, layer=int(i)) == sum(p.numel() for p in layer.parameters())


@pytest.mark.slow
def test_activation_term_equals_what_a_real_layer_keeps():
    """The four norms, GeGLU and q/k norms of a Gemma 3 layer, 2 x 256 tokens: its window of 64
    makes attention take a mask ([1, 1, 256, 256], or with documents [2, 1, 256, 256])."""
    from test_memory_plan import MEASURE_ENV

    cases = [("float32", "none", False, False), ("bfloat16", "none", False, False), ("bfloat16", "selective", False, False),
             ("bfloat16", "none", True, False), ("bfloat16", "none", False, True)]
    proc = subprocess.run([sys.executable, __file__, "layers", json.dumps(cases)], capture_output=True, text=True,
                          env={**os.environ, **MEASURE_ENV}, timeout=600, check=True)
    for (dtype, mode, lora, documents), got in zip(cases, json.loads(proc.stdout), strict=True):
        planned = layer_activation_bytes(memory_config(), 4 if dtype == "float32" else 2, mode, 1,
                                         LoraConfig(rank=8) if lora else None, 256, documents, batch=2)
        print(f"{dtype} {mode}{' LoRA' if lora else ''}{' documents' if documents else ''}: planned {planned:.0f}, "
              f"measured {got:.0f} bytes/token")
        # As test_memory_plan's: 2% plus 64 KiB per layer, 128 bytes per token of the 512.
        assert abs(planned - got) <= 0.02 * got + 128, (dtype, mode, lora, documents, planned, got)


if __name__ == "__main__":
    import gc

    import test_memory_plan

    test_memory_plan.LAYER_CONFIGS["gemma3"] = memory_config
    gc.freeze()
    print(json.dumps([test_memory_plan.measure_layer(*case, "gemma3") for case in json.loads(sys.argv[2])]))
