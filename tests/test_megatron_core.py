"""Megatron checkpoints made and read by megatron-core itself (``megatron_worker.py``, ranks on
CPU under gloo): llmflow's import of them computes megatron-core's logits (fp32, within
1e-5) from torch_dist and legacy files at tp=1 and at tp=2/pp=2, and a Hugging Face model
exported to torch_dist, loaded by megatron-core's ``dist_checkpointing.load`` (default
strictness) into a tp=2/pp=2 GPTModel, saved again by megatron-core and imported comes back
bit-exact. A mixture-of-experts model does the same at ep=2, megatron-core's MoE layer
(router, SequentialMLP experts, shared expert and its gate) computing transformers' logits on
CPU, and comes back from megatron-core's torch_dist and legacy (per expert-parallel rank)
saves bit-exact; so do DeepSeek-V3 (Multi-head Latent Attention with YaRN or plain rotary, the
sigmoid router with its correction bias and groups, ungated shared experts, a dense first
layer) and GLM-4.5 (partial rotary, q/k norms, the same router)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_glm4_moe
import test_mla
import torch
from forked_workers import run_forked
from test_convert import add_tokenizer, hf_tensors
from test_megatron import assert_comes_back

from llmflow.weights import load_model
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export

TOLERANCE = 1e-5
SHAPES = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}

pytestmark = pytest.mark.slow


def run_worker(ranks: int, *args: str) -> None:
    """megatron_worker.py's main on ``ranks`` gloo ranks (forked with megatron-core imported);
    their output, beside the worker's --out, shown when it fails."""
    run_forked(
        "megatron_worker:main",
        list(args),
        ranks,
        Path(args[args.index("--out") + 1]),
        {"OMP_NUM_THREADS": "1"},
        process_group=True,
    )


def hf_config_dir(path: Path, family: str, tied: bool) -> Path:
    """A Hugging Face model directory holding only config.json (the converter reads no weights from it)."""
    path.mkdir()
    config = {
        **SHAPES,
        "model_type": family,
        "tie_word_embeddings": tied,
        "rope_theta": 10000.0,
        "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def llmflow_logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_model(checkpoint)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize(
    ("family", "tied", "tp", "pp"),
    [("qwen2", True, 1, 1), ("llama", False, 2, 2)],
    ids=["qwen2-tied-tp1", "llama-tp2-pp2"],
)
def test_import_computes_megatron_cores_logits(tmp_path, family, tied, tp, pp):
    hf = hf_config_dir(tmp_path / "hf", family, tied)
    made = tmp_path / "made"
    run_worker(
        tp * pp,
        "make",
        "--config",
        str(hf / "config.json"),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--iteration",
        "20",
        "--out",
        str(made),
        "--legacy",
    )
    reference = torch.load(made / "logits.pt")
    for layout in ("torch_dist", "legacy"):
        checkpoint = convert(ConvertConfig(hf=hf, megatron=made / layout, out=tmp_path / layout))
        ours = llmflow_logits(checkpoint, reference["input_ids"])
        assert ours.shape == reference["logits"].shape
        assert (ours - reference["logits"]).abs().max().item() <= TOLERANCE, layout


def test_round_trip_through_megatron_core_is_bit_exact(make_hf_model, tmp_path):
    hf_model, hf_dir = make_hf_model("llama", **{k: v for k, v in SHAPES.items() if k != "rms_norm_eps"})
    add_tokenizer(hf_dir)
    checkpoint = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    exported = export(ExportConfig(ckpt=checkpoint, megatron=tmp_path / "megatron", tp=2, pp=2, iteration=30))
    loaded = tmp_path / "loaded"
    run_worker(4, "load", "--load", str(exported), "--tp", "2", "--pp", "2", "--out", str(loaded), "--resave")
    reference = torch.load(loaded / "logits.pt")
    with torch.no_grad():
        hf_logits = hf_model(reference["input_ids"]).logits
    assert (reference["logits"] - hf_logits).abs().max().item() <= TOLERANCE  # megatron-core ran our weights
    back = convert(ConvertConfig(hf=hf_dir, megatron=loaded / "torch_dist", out=tmp_path / "back"))
    again = hf_tensors(export(ExportConfig(ckpt=back, out=tmp_path / "hf-again")))
    original = hf_tensors(hf_dir)
    assert sorted(again) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name


MOE_SHAPES = {k: v for k, v in SHAPES.items() if k != "rms_norm_eps"} | {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "head_dim": 16,
}
MOE_CASES = {
    # shared expert with its gate, q/k/v biases, top-k weights not renormalised
    # (moe_router_pre_softmax), a dense layer among the MoE layers (each layer under its own keys)
    "qwen2_moe-tp2-ep2": (
        "qwen2_moe",
        {"shared_expert_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False},
        2,
        1,
    ),
    # per-head q/k norms, top-k renormalised, every layer routed (layers stacked)
    "qwen3_moe-pp2-ep2": ("qwen3_moe", {"norm_topk_prob": True}, 1, 2),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_round_trip_through_megatron_core(make_hf_model, tmp_path, case):
    """Export (torch_dist, Transformer Engine spec names, args for ep=2) -> megatron-core's
    ``dist_checkpointing.load`` into a MoE GPTModel at ep=2 (its logits against transformers',
    fp32, 1e-5) -> megatron-core's own torch_dist and legacy saves -> import -> bit-exact."""
    family, extra, tp, pp = MOE_CASES[case]
    hf_model, hf_dir = make_hf_model(family, **MOE_SHAPES, **extra)
    add_tokenizer(hf_dir)
    checkpoint = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    exported = export(ExportConfig(ckpt=checkpoint, megatron=tmp_path / "megatron", tp=tp, pp=pp, ep=2, iteration=30))
    loaded = tmp_path / "loaded"
    run_worker(
        tp * pp * 2,
        "load",
        "--load",
        str(exported),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--ep",
        "2",
        "--out",
        str(loaded),
        "--resave",
        "--legacy",
    )
    reference = torch.load(loaded / "logits.pt")
    with torch.no_grad():
        hf_logits = hf_model(reference["input_ids"]).logits
    assert (reference["logits"] - hf_logits).abs().max().item() <= TOLERANCE  # megatron-core ran our weights
    ranks = sorted(p.name for p in (loaded / "legacy" / "iter_0000030").iterdir())
    assert ranks == [
        f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + f"_{e:03d}"
        for t in range(tp)
        for s in range(pp)
        for e in range(2)
    ]
    for layout in ("torch_dist", "legacy"):
        assert_comes_back(hf_dir, loaded / layout, tmp_path, f"back-{layout}")


# test_mla's DeepSeek-V3 and test_glm4_moe's GLM-4.5 cases (module, case) with some values changed, made
# by the module's hf_model (each router's correction bias random and nonzero). DeepSeek-V3 with
# rms_norm_eps the latent norms' (megatron-core's MLA normalises the latents with the layers' eps).
SIGMOID_CASES = {
    # q_a_proj/q_b_proj, YaRN (positions past 16 rescaled), layer 0 dense, then the sigmoid router: 8
    # experts in 2 groups of 4, the best group kept, 2 per token (megatron-core scores a group by its
    # best top_k // topk_group = 2, as DeepSeek does), weights renormalised and scaled by 2.5, 2 ungated
    # shared experts; Transformer Engine spec names
    "deepseek_v3-moe-yarn-tp2-ep2": (
        test_mla,
        "moe_yarn",
        {"rms_norm_eps": 1e-6, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2},
        {},
        2,
        1,
        2,
    ),
    # one q_proj, rotary on halves (its rows reordered into megatron-core's pairs), plain rotary, tied
    # embeddings, every layer dense (stacked); the local spec's names
    "deepseek_v3-q_proj-halves-pp2": (
        test_mla,
        "q_proj_yarn_halves_tied",
        {"rms_norm_eps": 1e-6, "rope_parameters": None},
        {"megatron_spec": "local"},
        1,
        2,
        1,
    ),
    # GQA with rotary over half of each head (rotary_percent), q/k norms, tied embeddings, layer 0 dense,
    # then 8 experts in 4 groups of 2, the best 2 kept, 4 per token
    "glm4_moe-ep2": (test_glm4_moe, "glm4_5", {"num_experts_per_tok": 4}, {}, 1, 1, 2),
}


@pytest.mark.parametrize("case", list(SIGMOID_CASES))
def test_sigmoid_router_and_mla_round_trip_through_megatron_core(make_hf_model, tmp_path, monkeypatch, case):
    """A tiny DeepSeek-V3 (Multi-head Latent Attention) or GLM-4.5 exported to torch_dist ->
    megatron-core's ``dist_checkpointing.load`` into a GPTModel (``MLASelfAttention`` or
    ``SelfAttention``, the sigmoid ``TopKRouter`` with its expert bias, local spec) whose logits
    are transformers' (fp32, 1e-5, 40 positions: YaRN's rescaled ones included) ->
    megatron-core's torch_dist and legacy saves -> import -> bit-exact."""
    module, base, overrides, options, tp, pp, ep = SIGMOID_CASES[case]
    monkeypatch.setitem(module.CASES, case, {**module.CASES[base], "vocab_size": 100, **overrides})
    hf, hf_dir = module.hf_model(make_hf_model, case)
    add_tokenizer(hf_dir)
    checkpoint = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    exported = export(
        ExportConfig(ckpt=checkpoint, megatron=tmp_path / "megatron", tp=tp, pp=pp, ep=ep, iteration=30, **options)
    )
    ids = tmp_path / "ids.pt"
    torch.save(torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0)), ids)
    loaded = tmp_path / "loaded"
    run_worker(
        tp * pp * ep,
        "load",
        "--load",
        str(exported),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--ep",
        str(ep),
        "--ids",
        str(ids),
        "--out",
        str(loaded),
        "--resave",
        "--legacy",
    )
    reference = torch.load(loaded / "logits.pt")
    with torch.no_grad():
        hf_logits = hf(reference["input_ids"]).logits
    difference = (reference["logits"] - hf_logits).abs().max().item()
    print(f"{case}: megatron-core's logits within {difference:.1e} of transformers'")
    assert difference <= TOLERANCE  # megatron-core ran our weights
    for layout in ("torch_dist", "legacy"):
        assert_comes_back(hf_dir, loaded / layout, tmp_path, f"back-{layout}")
