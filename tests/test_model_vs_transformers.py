"""llmflow.models against transformers on the same tiny random weights (fp32)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import llmflow.kernels as K
from llmflow.models import CausalLM, ConfigError, ModelConfig
from llmflow.models.blocks.rotary import inverse_frequencies
from llmflow.weights import CheckpointError, load_hf_model, save_hf_model

# Max abs difference between our fp32 logits/losses/grads and transformers' (or the reference path's).
ATOL = 1e-5
BATCH, SEQ = 2, 40

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Far below SEQ, so the scaling changes frequencies that the test sequence uses.
    "original_max_position_embeddings": 32,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}

CASES = {
    "llama_mha_untied": ("llama", {}),
    "llama_gqa": ("llama", {"num_key_value_heads": 2}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_attention_bias": ("llama", {"attention_bias": True, "num_key_value_heads": 2}),
    "llama_mlp_bias": ("llama", {"mlp_bias": True}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "num_key_value_heads": 2}),
    "llama_linear_rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama_rope_theta_500k": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "qwen2_untied_gqa": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2_tied_gqa": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None, "num_key_value_heads": 2}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 8, "num_key_value_heads": 2}),
    # Qwen3: head_dim 24 or 8, not hidden_size / heads = 16.
    "qwen3_untied_gqa": ("qwen3", {"num_key_value_heads": 2, "head_dim": 24}),
    "qwen3_tied_gqa": ("qwen3", {"num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": True}),
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True, "head_dim": 8, "rope_parameters": LINEAR_ROPE}),
    "qwen3_sliding_window": ("qwen3", {"num_key_value_heads": 2, "head_dim": 24, "use_sliding_window": True,
                                       "sliding_window": 8, "max_window_layers": 0}),
}


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def logits_pair(hf, ours, ids, **kw):
    with torch.no_grad():
        return ours(ids, **kw), hf(ids).logits


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, make_hf_model, tokens):
    family, overrides = CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path).eval()
    assert isinstance(ours, CausalLM)
    assert ours.config.model_type == family
    ids = tokens(BATCH, SEQ)
    got, expected = logits_pair(hf, ours, ids)
    assert got.shape == (BATCH, SEQ, hf.config.vocab_size)
    assert got.dtype == torch.float32
    assert_close(got, expected)
    # The structure the case is about really is there.
    attn = ours.model.layers["0"].self_attn
    if family == "qwen2":
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
        assert attn.o_proj.bias is None
    if family == "qwen3":
        assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (overrides["head_dim"],)
        assert (attn.q_proj.bias is not None) == (attn.o_proj.bias is not None) == bool(overrides.get("attention_bias"))
        assert attn.sliding_window == overrides.get("sliding_window")
    else:
        assert attn.q_norm is None and attn.k_norm is None
    if overrides.get("attention_bias"):
        assert attn.q_proj.bias is not None and attn.o_proj.bias is not None
        assert attn.q_proj.bias.abs().max() > 0
    if overrides.get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    else:
        assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    assert attn.k_proj.out_features == hf.config.num_key_value_heads * hf.model.layers[0].self_attn.head_dim


def test_llama3_scaling_changes_the_frequencies(make_hf_model):
    hf, path = make_hf_model("llama", rope_parameters=LLAMA3_ROPE)
    ours = load_hf_model(path)
    plain = ModelConfig.from_hf({**json.loads((path / "config.json").read_text()), "rope_parameters": {"rope_theta": 10000.0}})
    base = inverse_frequencies(plain)
    scaled = ours.model.inv_freq
    assert_close(scaled, hf.model.rotary_emb.inv_freq, atol=0.0)
    # head_dim 16 -> wavelengths 6.3 (kept), 20 (smoothed), >32 (divided by factor 8)
    assert scaled[0] == base[0]
    assert base[1] / 8 < scaled[1] < base[1]
    assert_close(scaled[2:], base[2:] / 8, atol=0.0)


@pytest.mark.parametrize("family,overrides", [("llama", {"num_key_value_heads": 2}), ("qwen2", {"tie_word_embeddings": True})])
def test_sharded_checkpoint(family, overrides, make_hf_model, tokens):
    hf, path = make_hf_model(family, save_kwargs={"max_shard_size": "20KB"}, **overrides)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    ours = load_hf_model(path)
    got, expected = logits_pair(hf, ours, tokens(BATCH, SEQ))
    assert_close(got, expected)


@pytest.mark.parametrize(
    "rope,old_scaling",
    [
        (LINEAR_ROPE, {"type": "linear", "factor": 4.0}),
        (LLAMA3_ROPE, {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_theta", "rope_type")} | {"type": "llama3"}),
        ({"rope_type": "default", "rope_theta": 20000.0}, None),
    ],
    ids=["linear", "llama3", "default"],
)
def test_transformers4_config_spelling(rope, old_scaling, make_hf_model, tokens):
    hf, path = make_hf_model("llama", rope_parameters=rope)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = old_scaling
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.46.0"
    cfg_path.write_text(json.dumps(cfg))
    config = ModelConfig.from_file(path)
    assert config.rope_theta == rope["rope_theta"]
    assert config.rope_type == rope["rope_type"]
    assert config.torch_dtype == "float32"
    ours = load_hf_model(path)
    got, expected = logits_pair(hf, ours, tokens(BATCH, SEQ))
    assert_close(got, expected)


def _labels(ids):
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[0, :5] = -100  # a prompt
    labels[1, 10:13] = -100
    return labels


LOSS_CASES = {
    "llama_gqa": ("llama", {"num_key_value_heads": 2}),
    "qwen2_tied": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3_gqa": ("qwen3", {"num_key_value_heads": 2, "head_dim": 24}),
}
GRAD_PARAMS = [
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
]
QK_NORM_GRAD_PARAMS = ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"]


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_matches_cross_entropy_on_transformers_logits(case, make_hf_model, tokens):
    family, overrides = LOSS_CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path)
    ids = tokens(BATCH, 24)
    labels = _labels(ids)
    with torch.no_grad():
        expected = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        expected_sum = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss = ours(ids, labels=labels)
    assert loss.ndim == 0
    assert_close(loss.detach(), expected)
    with K.use_kernels(K.REFERENCE):
        assert_close(ours(ids, labels=labels).detach(), expected)
    with torch.no_grad():
        assert_close(ours(ids, labels=labels, loss_reduction="sum"), expected_sum, atol=ATOL * labels.numel())


def _grads(model, names):
    params = dict(model.named_parameters(remove_duplicate=False))
    return {n: params[n].grad.clone() if params[n].grad is not None else None for n in names}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_gradients_match_reference_path(case, make_hf_model, tokens):
    family, overrides = LOSS_CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path)
    ids = tokens(BATCH, 24)
    labels = _labels(ids)
    names = GRAD_PARAMS + (QK_NORM_GRAD_PARAMS if family == "qwen3" else [])

    with K.use_kernels(K.REFERENCE):
        ours(ids, labels=labels).backward()
    reference = _grads(ours, names)
    ours.zero_grad(set_to_none=True)
    ours(ids, labels=labels).backward()
    fused = _grads(ours, names)

    hf.train()  # dropout is 0; train() only so transformers tracks grads the usual way
    F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    hf_grads = _grads(hf, names)

    for name in names:
        assert reference[name] is not None, f"reference path: no gradient for {name}"
        assert_close(reference[name], hf_grads[name])
        assert fused[name] is not None, f"fused path: no gradient for {name}"
        assert_close(fused[name], reference[name])


@pytest.mark.parametrize("case", ["llama_gqa", "qwen2_tied", "llama3_rope", "qwen3_tied_gqa"])
def test_packed_documents_equal_separate_documents(case, make_hf_model, tokens):
    family, overrides = CASES.get(case) or LOSS_CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 7, 7, 7, 7]])
    ids = tokens(2, docs.shape[1], seed=3)
    with torch.no_grad():
        packed = ours(ids, document_ids=docs)
        checked = 0
        for b in range(2):
            for d in docs[b].unique():
                idx = (docs[b] == d).nonzero().squeeze(1)
                alone = hf(ids[b : b + 1, idx]).logits
                assert_close(packed[b : b + 1, idx], alone)
                checked += 1
        assert checked == 5
        # Without document ids the later documents see the earlier ones: the logits differ.
        assert (ours(ids)[0, 3:] - packed[0, 3:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "case,max_shard_bytes",
    [
        ("llama_mha_untied", None),
        ("llama_tied", None),
        ("qwen2_tied_gqa", None),
        ("llama3_rope", None),
        ("mistral_sliding_window", None),
        ("llama_gqa", 30_000),
        ("qwen2_untied_gqa", 30_000),
        ("qwen3_tied_gqa", None),
        ("qwen3_attention_bias", 30_000),
    ],
)
def test_save_hf_model_loads_in_transformers(case, max_shard_bytes, make_hf_model, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    family, overrides = CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path)
    out = tmp_path / "export"
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    assert save_hf_model(ours, out, **kw) == out
    if max_shard_bytes is None:
        assert (out / "model.safetensors").is_file()
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert not (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    ids = tokens(BATCH, SEQ, seed=1)
    with torch.no_grad():
        got = reloaded(ids).logits
        assert_close(got, hf(ids).logits)
        assert_close(got, ours(ids))
    # and our own loader reads it back too
    again = load_hf_model(out)
    with torch.no_grad():
        assert_close(again(ids), got)


def test_save_hf_model_of_transformers4_config_loads_in_transformers(make_hf_model, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, path = make_hf_model("llama", rope_parameters=LINEAR_ROPE)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0}, torch_dtype=cfg.pop("dtype"))
    (path / "config.json").write_text(json.dumps(cfg))
    out = save_hf_model(load_hf_model(path), tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert_close(reloaded(ids).logits, hf(ids).logits)


# ----------------------------------------------------------------------------- errors


def _rewrite_single(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_raises(make_hf_model):
    _, path = make_hf_model("llama")
    _rewrite_single(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_model(path)


def test_untied_checkpoint_without_lm_head_raises(make_hf_model):
    _, path = make_hf_model("llama", tie_word_embeddings=False)
    _rewrite_single(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_hf_model(path)


def test_wrong_shape_raises(make_hf_model):
    _, path = make_hf_model("llama")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_single(path, lambda t: t.__setitem__(name, torch.zeros(8, 64)))
    with pytest.raises(CheckpointError) as err:
        load_hf_model(path)
    msg = str(err.value)
    assert name in msg and "model.safetensors" in msg
    assert "(8, 64)" in msg and "(64, 64)" in msg


def test_unexpected_tensor_raises(make_hf_model):
    _, path = make_hf_model("llama")
    _rewrite_single(path, lambda t: t.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(96, 64)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.7\.mlp\.up_proj\.weight"):
        load_hf_model(path)


def test_rotary_inv_freq_in_checkpoint_is_ignored(make_hf_model, tokens):
    hf, path = make_hf_model("llama")
    _rewrite_single(path, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)))
    got, expected = logits_pair(hf, load_hf_model(path), tokens(1, 12))
    assert_close(got, expected)


def test_no_safetensors_file_raises(make_hf_model):
    _, path = make_hf_model("llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        load_hf_model(path)
    assert str(path) in str(err.value) and "model.safetensors" in str(err.value)


def test_index_naming_absent_shard_raises(make_hf_model):
    _, path = make_hf_model("llama", save_kwargs={"max_shard_size": "20KB"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = max(set(index["weight_map"].values()))
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_hf_model(path)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_model_type_raises(make_hf_model):
    _, path = make_hf_model("llama")
    _edit_config(path, model_type="gpt_neox")
    with pytest.raises(ConfigError, match="gpt_neox"):
        load_hf_model(path)


def test_unsupported_model_type_names_every_registered_family():
    from llmflow.models.config import FAMILIES

    assert {"llama", "qwen2", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "deepseek_v3"} <= set(FAMILIES)
    with pytest.raises(ConfigError, match=re.escape(f"model_type='gpt2' is not supported; expected one of "
                                                    f"{tuple(FAMILIES)}")):
        ModelConfig.from_hf({"model_type": "gpt2"})


@pytest.mark.parametrize(
    "changes,name",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}}, "longrope"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
    ids=["new_spelling", "old_spelling"],
)
def test_unsupported_rope_type_raises(changes, name, make_hf_model):
    _, path = make_hf_model("llama")
    _edit_config(path, **changes)
    with pytest.raises(ConfigError, match=name):
        load_hf_model(path)


QWEN3_SHAPE = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4}


def test_qwen3_head_dim_defaults_as_in_transformers():
    from transformers import Qwen3Config

    assert ModelConfig.from_hf({"model_type": "qwen3", **QWEN3_SHAPE}).head_dim == Qwen3Config(**QWEN3_SHAPE).head_dim
    assert ModelConfig.from_hf({"model_type": "llama", **QWEN3_SHAPE}).head_dim == 16


SLIDING = {"use_sliding_window": True, "sliding_window": 8}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("changes", [
    {}, {**SLIDING, "max_window_layers": 0}, {**SLIDING, "max_window_layers": 2}, {**SLIDING, "use_sliding_window": False},
    {**SLIDING, "layer_types": ["sliding_attention"] * 2}, {"use_sliding_window": True},
])
def test_qwen_sliding_window_is_read_as_transformers_reads_it(family, changes):
    import transformers

    hf = transformers.AutoConfig.for_model(family, **QWEN3_SHAPE, **changes)
    per_layer = {hf.sliding_window if kind == "sliding_attention" else None for kind in hf.layer_types}
    assert len(per_layer) == 1
    assert ModelConfig.from_hf({"model_type": family, **QWEN3_SHAPE, **changes}).sliding_window == per_layer.pop()


@pytest.mark.parametrize("changes, message", [
    ({**SLIDING, "max_window_layers": 1}, r"a sliding window on 1 of 2 layers \(layer_types/max_window_layers\)"),
    ({**SLIDING, "layer_types": ["full_attention", "sliding_attention"]}, "a sliding window on 1 of 2 layers"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types has sliding_attention layers but use_sliding_window/"),
    ({"layer_types": ["linear_attention"] * 2}, r"layer_types \['linear_attention'\] are not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_windows_llmflow_cannot_apply_are_refused(family, changes, message):
    with pytest.raises(ConfigError, match="^config.json: " + message):
        ModelConfig.from_hf({"model_type": family, **QWEN3_SHAPE, **changes})


def test_missing_config_raises(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_model(tmp_path)


# ----------------------------------------------------------------------------- materialisation


@pytest.mark.parametrize("case", ["llama_tied", "llama3_rope", "qwen2_untied_gqa", "qwen3_untied_gqa"])
def test_loaded_model_is_fully_materialised(case, make_hf_model):
    family, overrides = CASES[case]
    hf, path = make_hf_model(family, **overrides)
    ours = load_hf_model(path)
    for name, p in ours.named_parameters():
        assert not p.is_meta, f"{name} left on the meta device"
        assert p.device.type == "cpu" and p.dtype == torch.float32
        assert p.requires_grad
    for name, b in ours.named_buffers():
        assert not b.is_meta, f"buffer {name} left on the meta device"
    inv_freq = ours.model.inv_freq
    assert torch.isfinite(inv_freq).all() and (inv_freq > 0).all()
    assert_close(inv_freq, hf.model.rotary_emb.inv_freq, atol=0.0)
    # every parameter carries the checkpoint's values
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    for name, p in ours.named_parameters(remove_duplicate=False):
        assert torch.equal(p, hf_params[name]), name


def test_load_in_bfloat16(make_hf_model, tokens):
    hf, path = make_hf_model("llama", num_key_value_heads=2)
    ours = load_hf_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids = tokens(1, 16)
    with torch.no_grad():
        got = ours(ids).float()
        expected = hf(ids).logits
    # bf16 weights and activations through 2 layers: a few bf16 ulps of logits of size ~1.
    assert_close(got, expected, atol=0.1)
