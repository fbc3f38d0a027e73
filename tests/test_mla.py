"""DeepSeek-V3's Multi-head Latent Attention (``models/blocks/mla.py``, the ``deepseek_v3``
family) against transformers' ``DeepseekV3ForCausalLM`` on tiny random weights (fp32, eager
attention), every layer dense or a dense first layer before DeepSeek's mixture of experts (a
random nonzero correction bias): logits with and without the query's low-rank bottleneck, with
YaRN scaling (mscale and mscale_all_dim apart, so both the rotary attention factor and the
softmax scale differ from 1), interleaved and half-split rotary; packed documents; greedy
generation through llmflow's generator; the checkpoint and config round trip; LoRA on MLA's
projections against PEFT; tensor parallelism (the training plan's logits and every gradient,
the generation plan's decoding, and tp=2 training losses) against one process; and what is
refused: config.json keys the family cannot express (by name), context parallelism, the Megatron
export of what megatron-core computes otherwise."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil

import pytest
import torch
from forked_workers import run_forked
from safetensors.torch import load_file, save_file
from test_generate import VOCAB, add_tokenizer, hf_greedy
from train_helpers import assert_close as assert_losses_close
from train_helpers import config as train_config
from train_helpers import run, train_in_subprocess, training_assets

from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer.generate import GenerateConfig, generate
from llmflow.models import CausalLM, ConfigError, ModelConfig
from llmflow.models.blocks.mla import MultiHeadLatentAttention
from llmflow.models.blocks.moe import MoE
from llmflow.models.context_parallel import context_parallel_problems
from llmflow.models.lora import LoraConfig, apply_lora, lora_state_dict
from llmflow.weights import CheckpointError, load_hf_model, load_model, save_hf_model
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.tokenizer_files import copy_tokenizer_files

ATOL = 1e-5
BATCH, SEQ = 2, 40

# Every layer dense; head widths apart from each other (nope 12 + rope 8 = 20 for q/k, 10 for v);
# rms_norm_eps apart from the latent norms' fixed 1e-6.
MLA = {"first_k_dense_replace": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
       "v_head_dim": 10, "rms_norm_eps": 1e-5}
# max_position_embeddings 128 = factor 8 x 16: positions past 16 are where YaRN changes the frequencies.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 8, "beta_slow": 1}
# 8 experts in 4 groups of 2, the best 2 groups kept, 3 experts per token, 2 shared experts.
ROUTING = {"n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
CASES = {
    "q_lora": {**MLA, "q_lora_rank": 24},
    "q_proj_attention_bias": {**MLA, "q_lora_rank": None, "attention_bias": True},
    "q_lora_yarn": {**MLA, "q_lora_rank": 24, "rope_parameters": YARN},
    "q_proj_yarn_halves_tied": {**MLA, "q_lora_rank": None, "rope_interleave": False, "tie_word_embeddings": True,
                                "rope_parameters": {**YARN, "truncate": False, "beta_fast": None}},
    # Layer 0 dense, layers 1-2 DeepSeek's mixture of experts.
    "moe_yarn": {**MLA, **ROUTING, "q_lora_rank": 24, "num_hidden_layers": 3, "first_k_dense_replace": 1,
                 "rope_parameters": YARN},
}
# Kimi K2's shape: 1 dense layer, then experts in one group (n_group = topk_group = 1), one
# shared expert, its YaRN (beta_fast = beta_slow = 1, both mscales 1) and routed scaling.
KIMI_K2 = {**MLA, **ROUTING, "q_lora_rank": 24, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_group": 1,
           "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.827,
           "rope_parameters": {**YARN, "beta_fast": 1, "beta_slow": 1, "mscale_all_dim": 1.0}}
KIMI_K2_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                    "AutoModel": "modeling_deepseek.DeepseekV3Model",
                    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
MLA_TARGETS = ["q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def hf_model(make_hf_model, case: str, **extra):
    """The tiny transformers model of ``case``; with experts, each router's correction bias
    random and nonzero (transformers initialises it to zero), saved again with it."""
    hf, path = make_hf_model("deepseek_v3", **{**CASES[case], **extra})
    if "n_routed_experts" in CASES[case]:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for layer in hf.model.layers[CASES[case]["first_k_dense_replace"]:]:
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
        got, expected = ours(ids), hf(ids).logits
    print(f"{case}: largest logit difference {(got - expected).abs().max():.1e}")
    assert_close(got, expected)
    attention, reference = ours.model.layers["0"].self_attn, hf.model.layers[0].self_attn
    assert isinstance(attention, MultiHeadLatentAttention)
    assert attention.low_rank_query == (CASES[case]["q_lora_rank"] is not None)
    assert attention.scale == reference.scaling
    assert ours.model.rotary_scale == hf.model.rotary_emb.attention_scaling
    assert torch.equal(ours.model.inv_freq, hf.model.rotary_emb.inv_freq)
    assert (attention.o_proj.bias is not None) == bool(CASES[case].get("attention_bias"))
    if "rope_parameters" in CASES[case]:
        assert attention.scale != 20**-0.5 and ours.model.rotary_scale != 1.0
    routed = [int(n) for n, layer in ours.model.layers.items() if isinstance(layer.mlp, MoE)]
    assert routed == [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert ours.config.num_experts == CASES[case].get("n_routed_experts", 0)
    for name in routed:
        moe = ours.model.layers[str(name)].mlp
        assert torch.equal(moe.gate.e_score_correction_bias, hf.model.layers[name].mlp.gate.e_score_correction_bias)
        assert moe.gate.e_score_correction_bias.abs().max() > 0 and moe.shared_experts is not None


def test_llama_with_yarn_scales_cos_and_sin_as_transformers(make_hf_model, tokens):
    """YaRN in the shared attention: its frequencies and the attention factor on cos and sin."""
    hf, path = make_hf_model("llama", rope_parameters={k: v for k, v in YARN.items() if k != "mscale_all_dim"})
    ours = load_hf_model(path).eval()
    assert ours.model.rotary_scale == hf.model.rotary_emb.attention_scaling > 1.0
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits)


@pytest.mark.parametrize("case", ["q_lora_yarn", "q_proj_attention_bias", "moe_yarn"])
def test_packed_documents_equal_separate_documents(case, make_hf_model, tokens):
    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path).eval()
    docs = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [5] * 8 + [7] * 4 + [9]])
    ids = tokens(2, docs.shape[1], seed=3)
    with torch.no_grad():
        packed = ours(ids, document_ids=docs)
        for b in range(2):
            for d in docs[b].unique():
                idx = (docs[b] == d).nonzero().squeeze(1)
                assert_close(packed[b : b + 1, idx], hf(ids[b : b + 1, idx]).logits)
        assert (ours(ids)[0, 5:] - packed[0, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["q_lora_yarn", "q_proj_yarn_halves_tied", "moe_yarn"])
def test_greedy_generation_matches_transformers(case, make_hf_model, static_generate):
    """Left-padded prompts of 7, 3, 12 and 1 tokens, their keys and values in the KV cache (the
    values narrower than the keys): each row generates what transformers generates for it alone,
    and what llmflow generates for it alone, over the growing KV cache and over the compiled
    step's static one."""
    hf, path = hf_model(make_hf_model, case, vocab_size=VOCAB)
    add_tokenizer(path)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12, 1)]
    eos = 5
    config = GenerateConfig(max_new_tokens=10, eos_token_ids=[eos])
    batched = [r.tokens for r in generate(model, tokenizer, prompts, config)]
    assert batched == [hf_greedy(hf, [p], 10, eos)[0] for p in prompts]
    assert batched == [generate(model, tokenizer, [p], config)[0].tokens for p in prompts]
    assert static_generate(model, tokenizer, prompts, config) == batched


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora-on-kv_b_proj"])
def test_the_cache_holds_the_latent_and_decoding_from_it_computes_the_full_forward(make_hf_model, tokens, lora):
    """Positions fed one at a time after a prefix, through the cache of latents and rotary key
    parts (kv_lora_rank + qk_rope_head_dim per position, one head), give the logits of one
    forward over the whole sequence (fp32, within 1e-5), past YaRN's original context and with
    a LoRA adapter on kv_b_proj, whose update the latent attention folds into the rows it uses."""
    from llmflow.models.kv_cache import KVCache

    _, path = hf_model(make_hf_model, "q_lora_yarn")
    model = load_hf_model(path).eval()
    if lora:
        apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["kv_b_proj"]))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for tensor in lora_state_dict(model).values():
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=g))
    ids = tokens(BATCH, 24)
    cache = KVCache(24)
    with torch.no_grad():
        whole = model(ids)
        stepped = [model(ids[:, :8], kv_cache=cache)]
        stepped += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(8, 24)]
    assert_close(torch.cat(stepped, dim=1), whole)
    config = model.config
    keys, values = cache._keys["0"], cache._values["0"]
    assert keys.shape == (BATCH, 1, 24, config.kv_lora_rank + config.qk_rope_head_dim) and values.shape[-1] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_and_config_round_trip_bit_exact(case, make_hf_model, tmp_path):
    _, path = hf_model(make_hf_model, case)
    saved = save_hf_model(load_hf_model(path), tmp_path / "out")
    original, written = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((saved / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_a_kimi_k2_checkpoint_computes_deepseek_v3s_logits_and_exports_as_itself(make_hf_model, tokens, tmp_path):
    """Kimi K2 ships DeepSeek-V3's architecture under model_type kimi_k2 (config and modelling code
    remote, by auto_map): read as DeepSeek-V3, it computes transformers' DeepseekV3ForCausalLM
    logits, and its export reproduces every tensor and its own config.json."""
    hf, path = make_hf_model("deepseek_v3", **KIMI_K2)
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    shutil.copy(path / "model.safetensors", kimi)
    config = {**json.loads((path / "config.json").read_text()), "model_type": "kimi_k2", "auto_map": KIMI_K2_AUTO_MAP}
    (kimi / "config.json").write_text(json.dumps(config))
    ours = load_hf_model(kimi).eval()
    assert ours.config.model_type == "kimi_k2" and ours.config.n_group == 1
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        got, expected = ours(ids), hf(ids).logits
    print(f"kimi_k2: largest logit difference {(got - expected).abs().max():.1e}")
    assert_close(got, expected)
    saved = save_hf_model(ours, tmp_path / "out")
    assert json.loads((saved / "config.json").read_text()) == config
    original, written = load_file(kimi / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(original) and all(torch.equal(written[n], t) for n, t in original.items())


def test_the_multi_token_prediction_layer_is_left_out(make_hf_model, tokens, tmp_path, caplog):
    """DeepSeek-V3's checkpoints hold it as layer num_hidden_layers (``model.layers.61``):
    left out, said in one line."""
    hf, path = hf_model(make_hf_model, "moe_yarn")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(88, 16)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids = tokens(1, 12)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        assert_close(load_hf_model(tmp_path)(ids), hf(ids).logits)
    assert "left out 2 tensors of the multi-token prediction layer (model.layers.3.*)" in caplog.text


@pytest.mark.parametrize("case", ["q_lora_yarn", "q_proj_attention_bias"])
def test_lora_on_mla_projections_computes_what_peft_does(case, make_hf_model, tokens):
    """Adapters on every MLA projection, named by the Hugging Face modules they adapt, and with
    random values the logits of PEFT's adapters of the same values on transformers' model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path)
    query = ["q_a_proj", "q_b_proj"] if "q_lora" in case else ["q_proj"]
    targets = [*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    adapted = apply_lora(ours, LoraConfig(rank=4, alpha=8.0, target_modules=targets), torch.Generator().manual_seed(0))
    assert adapted == [f"model.layers.{i}.self_attn.{t}" for i in range(2) for t in targets]
    adapters = lora_state_dict(ours)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tensor in adapters.values():
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=g))
    peft = get_peft_model(copy.deepcopy(hf), PeftLoraConfig(r=4, lora_alpha=8.0, target_modules=targets))
    theirs = {k.removeprefix("base_model.model.").replace(".default", ""): v
              for k, v in peft.state_dict().items() if "lora_" in k}
    assert theirs.keys() == adapters.keys()
    peft.load_state_dict({f"base_model.model.{k}".replace(".weight", ".default.weight"): v
                          for k, v in adapters.items()}, strict=False)
    ids = tokens(BATCH, 16)
    with torch.no_grad():
        assert_close(ours(ids), peft(input_ids=ids).logits)


def test_config_keys_mla_cannot_express_are_refused(make_hf_model):
    _, path = hf_model(make_hf_model, "q_lora_yarn")
    hf = json.loads((path / "config.json").read_text())
    rope = hf["rope_parameters"]
    bad = {
        "'mscale_all_dims'": {"rope_parameters": {**rope, "mscale_all_dims": 1.0}},
        "factor=None": {"rope_parameters": {k: v for k, v in rope.items() if k != "factor"}},
        "beta_fast='32'": {"rope_parameters": {**rope, "beta_fast": "32"}},
        "n_group=3": {"first_k_dense_replace": 1, "n_group": 3},
        "scoring_func='softmax'": {"first_k_dense_replace": 1, "scoring_func": "softmax"},
        "moe_layer_freq=2": {"first_k_dense_replace": 1, "moe_layer_freq": 2},
        "num_key_value_heads=2": {"num_key_value_heads": 2},
        "kv_lora_rank=0": {"kv_lora_rank": 0},
    }
    for message, changes in bad.items():
        with pytest.raises(ConfigError, match=f"^config.json: .*{message}"):
            ModelConfig.from_hf({**hf, **changes})
    # transformers 4's spelling: the scaling under rope_scaling, 'type' for rope_type.
    old = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")} | {"type": "yarn"}
    config = ModelConfig.from_hf({**{k: v for k, v in hf.items() if k != "rope_parameters"}, "rope_scaling": old})
    assert config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    # A YaRN scaling without original_max_position_embeddings: config.json's top-level key, else
    # max_position_embeddings (transformers' reading).
    missing = {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}
    assert ModelConfig.from_hf({**hf, "rope_parameters": missing}).rope_scaling[
        "original_max_position_embeddings"] == hf["max_position_embeddings"]
    top = ModelConfig.from_hf({**hf, "original_max_position_embeddings": 32})
    assert top.rope_scaling["original_max_position_embeddings"] == 32
    assert context_parallel_problems(ModelConfig.from_hf(hf), 2, 64) == []


@pytest.mark.parametrize(("case", "extra", "reason"), [
    ("q_lora", {}, ("deepseek_v3's Multi-head Latent Attention normalises its latents with eps 1e-06 and its layers "
                    "with rms_norm_eps=1e-05 (megatron-core's MLA: one eps, layernorm_epsilon, for both)")),
    ("moe_yarn", {"rms_norm_eps": 1e-6}, ("deepseek_v3's sigmoid router scores a group of experts by its best 2 "
                                          "(megatron-core: by its best num_experts_per_tok // topk_group = 3 // 2)")),
])
def test_megatron_export_refuses_what_megatron_core_computes_otherwise(make_hf_model, tmp_path, case, extra, reason):
    """What megatron-core's MLA and sigmoid router cannot compute as transformers does is refused
    in one line, before anything is written (the rest exports: test_megatron_core.py)."""
    _, path = hf_model(make_hf_model, case, **extra)
    ckpt = convert(ConvertConfig(hf=path, out=tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=f"^--megatron: {re.escape(reason)}$"):
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "m"))
    assert not (tmp_path / "m").exists()


# --- tensor parallelism ---------------------------------------------------------------------------

TP_CONFIG = {"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 2, "first_k_dense_replace": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
             "max_position_embeddings": 64, "rope_parameters": {**YARN, "original_max_position_embeddings": 8}}


def test_tensor_parallel_plans_compute_what_one_process_does(tmp_path):
    """Two gloo ranks: the training plan (sequence parallel; with and without the query's
    bottleneck, with and without LoRA adapters) gives one process's logits and every gradient,
    the replicated down projections' and norms' included; the generation plan decodes with
    each rank's heads from the cached latents as one process does."""
    output = run_forked("test_mla:tp_worker", [], 2, tmp_path / "tp", {"OMP_NUM_THREADS": "1"})
    assert sum("MLA tensor parallelism matches one process" in line for line in output) == 2, output


def tiny_mla(q_lora_rank: int | None) -> CausalLM:
    model = CausalLM(ModelConfig.from_hf({**TP_CONFIG, "q_lora_rank": q_lora_rank}))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=g))
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_training_plan(model: CausalLM, mesh, lora: bool) -> int:
    from llmflow.models.parallelize import parallelize_decoder

    if lora:
        apply_lora(model, LoraConfig(rank=4, target_modules=MLA_TARGETS), torch.Generator().manual_seed(3))
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for tensor in lora_state_dict(model).values():
                tensor.normal_(0.0, 0.1, generator=g)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, TP_CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, TP_CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(6))
    reference(ids, labels=labels).backward()
    parallelize_decoder(model, mesh, lora=lora)
    model(ids, labels=labels).backward()
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    assert trained and len(trained) == sum(p.requires_grad for p in reference.parameters())
    for name, param in trained:
        assert_close(_full(param.grad), reference.get_parameter(name).grad, atol=1e-6)
    with torch.no_grad():
        assert_close(model(ids), reference(ids))
    return len(trained)


def _check_generation_plan(model: CausalLM, mesh) -> None:
    from llmflow.models.kv_cache import KVCache
    from llmflow.models.parallelize import apply_tp_inference

    reference = copy.deepcopy(model)
    apply_tp_inference(model, mesh)
    ids = torch.randint(0, TP_CONFIG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(7))
    caches = KVCache(12), KVCache(12)
    with torch.no_grad():
        for step in (ids[:, :6], ids[:, 6:7], ids[:, 7:9]):
            assert_close(model(step, kv_cache=caches[0]), reference(step, kv_cache=caches[1]))
    keys, values = caches[0]._keys["0"], caches[0]._values["0"]
    assert keys.shape == (2, 1, 12, 16 + 8) and values.shape == (2, 1, 12, 0)  # the latents, whole on each rank


def tp_worker(argv: list[str] | None = None) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    ranks = (6, None)  # of the query's bottleneck; None: one q_proj
    checked = [_check_training_plan(tiny_mla(q_rank), mesh, lora) for q_rank in ranks for lora in (False, True)]
    for q_rank in ranks:
        _check_generation_plan(tiny_mla(q_rank), mesh)
    print(f"rank {dist.get_rank()}: MLA tensor parallelism matches one process ({checked} gradients)", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # as test_lora's worker: skip an interpreter teardown that has aborted in a gloo thread


STEPS = 4
TRAINED = ("q_lora_yarn", "q_proj_attention_bias", "moe_yarn")


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory, make_hf_model):
    """The sample data tokenized, and tiny MLA models over the sample's vocabulary."""
    assets = training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("mla"))
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    for case in TRAINED:
        _, path = hf_model(make_hf_model, case, vocab_size=vocab)
        copy_tokenizer_files(assets["model"], path)
        assets[case] = path
    return assets


def settings(assets, out, model: str, **overrides):
    return train_config(assets, out, model=str(assets[model]), steps=STEPS,
                        data={"kind": "pretrain", "paths": [str(assets["wiki"])], "document_attention": True},
                        **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("model", TRAINED)
def test_tp2_training_losses_equal_one_process(assets, tmp_path, model):
    """Packed documents, tp=2 (sequence parallel, MLA split by heads; a MoE layer's router,
    experts and shared experts whole on each rank, routing its own tokens) against one process."""
    one = train_in_subprocess(settings(assets, tmp_path / "one", model))
    two = run(settings(assets, tmp_path / "tp2", model, tp=2), 2)
    assert sorted(two) == list(range(1, STEPS + 1))
    print(f"{model}: largest loss difference {max(abs(two[s] - one[s]) for s in two):.1e}")
    assert_losses_close(two, one)
