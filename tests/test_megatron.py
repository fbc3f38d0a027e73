"""Megatron checkpoints without megatron-core: the fused-tensor layouts, export then import in
both formats (bit-exact back to the Hugging Face files), the torch_dist layout megatron-core
reads (its chunks, extra states, common.pt and metadata.json), and bad input named before
anything is written; DeepSeek-V3's Multi-head Latent Attention and sigmoid router (the rotary rows'
order, keys, shapes, args, legacy splits in both specs, what megatron-core computes otherwise
refused). ``test_megatron_core.py`` checks the same against megatron-core itself."""

from __future__ import annotations

import json
import re
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_convert import add_tokenizer, hf_tensors
from test_mla import CASES, hf_model
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from llmflow.artifacts import read_manifest
from llmflow.cli import main
from llmflow.models import ModelConfig
from llmflow.weights import CheckpointError
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.megatron.layout import (
    FC1,
    FC2,
    KV_DOWN,
    PROJ,
    Q_UP,
    QKV,
    QKV_BIAS,
    Attention,
    fuse,
    merge_shards,
    split_shards,
    unfuse,
    unmapped_layers,
)
from llmflow.weights.megatron.reader import load_pickled

GQA = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4}


def test_fused_qkv_and_tensor_parallel_shards_invert():
    attention = Attention(heads=4, groups=2, head_dim=3)
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    fused = attention.fuse(q, k, v)
    # group 0: query heads 0 and 1, then its key and value head; then group 1
    assert torch.equal(fused[:6], q[:6]) and torch.equal(fused[6:9], k[:3]) and torch.equal(fused[9:12], v[:3])
    assert all(torch.equal(a, b) for a, b in zip(attention.split(fused), (q, k, v)))
    assert all(
        torch.equal(a, b)
        for a, b in zip(attention.split(attention.fuse(q[:, 0], k[:, 0], v[:, 0])), (q[:, 0], k[:, 0], v[:, 0]))
    )
    fc1 = torch.arange(8.0)[:, None]  # gate rows 0-3, up rows 4-7
    shards = split_shards(FC1, fc1, 2)
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # each rank: its gate, its up
    for name, tensor in (
        (FC1, fc1),
        (QKV, fused),
        (QKV_BIAS, fused[:, 0]),
        (PROJ, torch.randn(4, 6)),
        (FC2, torch.randn(4, 6)),
    ):
        assert torch.equal(merge_shards(name, split_shards(name, tensor, 2)), tensor), name


@pytest.fixture(
    params=[("llama", False, {}), ("qwen2", True, {}), ("qwen3", False, {"head_dim": 24})],
    ids=["llama-untied", "qwen2-tied", "qwen3-untied"],
)
def model(request, make_hf_model, tmp_path):
    """A tiny GQA model with a tokenizer, and its llmflow checkpoint."""
    family, tied, extra = request.param
    _, hf_dir = make_hf_model(family, tie_word_embeddings=tied, **GQA, **extra)
    add_tokenizer(hf_dir)
    return hf_dir, convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_export_then_import_is_bit_exact(model, tmp_path, fmt):
    hf_dir, ckpt = model
    megatron = tmp_path / "megatron"
    main(
        [
            "export",
            "--ckpt",
            str(ckpt),
            "--megatron",
            str(megatron),
            "--tp",
            "2",
            "--pp",
            "2",
            "--megatron-format",
            fmt,
            "--iteration",
            "1000",
        ]
    )
    assert (megatron / "latest_checkpointed_iteration.txt").read_text() == "1000"
    if fmt == "legacy":
        ranks = sorted(p.parent.name for p in (megatron / "iter_0001000").glob("mp_rank_*/model_optim_rng.pt"))
        assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    main(["convert", "--hf", str(hf_dir), "--megatron", str(megatron), "--out", str(tmp_path / "back")])
    source = read_manifest(tmp_path / "back")["megatron"]
    assert source["format"] == fmt and source["iteration"] == 1000 and source["skipped"] == []
    export(ExportConfig(ckpt=tmp_path / "back", out=tmp_path / "hf"))
    original, exported = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_torch_dist_export_is_laid_out_as_megatron_core_saves(model, tmp_path):
    hf_dir, ckpt = model
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "m", tp=2, pp=2))
    directory = tmp_path / "m" / "iter_0000000"
    assert json.loads((directory / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    hf = json.loads((hf_dir / "config.json").read_text())
    tied, head_dim = hf["tie_word_embeddings"], hf.get("head_dim", 64 // 4)
    stored = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    qkv = stored["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (4, (4 + 2 * 2) * head_dim, 64)  # layers stacked; heads + 2 * groups of head_dim
    assert [tuple(c.offsets) for c in qkv.chunks] == [(i, 0, 0) for i in range(4)]  # one chunk per layer
    assert tuple(stored["embedding.word_embeddings.weight"].size) == (256, 64)  # 160 padded to 128 * tp
    assert ("output_layer.weight" in stored) != tied
    assert ("decoder.layers.self_attention.linear_qkv.bias" in stored) == (hf["model_type"] == "qwen2")
    qk_norm = hf["model_type"] == "qwen3"
    norms = {
        key: tuple(v.size) for key, v in stored.items() if key.endswith(("q_layernorm.weight", "k_layernorm.weight"))
    }
    per_head = {f"decoder.layers.self_attention.{n}.weight": (4, head_dim) for n in ("q_layernorm", "k_layernorm")}
    assert norms == (per_head if qk_norm else {})
    extra = sorted(k for k, v in stored.items() if isinstance(v, BytesStorageMetadata))
    assert len(extra) == 16 and extra[0] == "decoder.layers.mlp.linear_fc1._extra_state/shard_0_4"
    common = load_pickled(directory / "common.pt")
    args = common["args"]
    assert (common["iteration"], common["checkpoint_version"]) == (0, 3.0)
    assert (args.num_layers, args.num_query_groups, args.kv_channels, args.padded_vocab_size) == (4, 2, head_dim, 256)
    assert args.qk_layernorm == qk_norm
    assert (args.untie_embeddings_and_output_weights, args.swiglu, args.normalization) == (not tied, True, "RMSNorm")
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert (args.no_save_optim, args.no_save_rng) == (True, True)  # an export holds no optimizer or RNG state


def rewrite_args(directory: Path, **changes) -> None:
    """Change fields of the args in a torch_dist checkpoint's common.pt."""
    common = load_pickled(directory / "common.pt")
    common["args"] = Namespace(**{**vars(common["args"]), **changes})
    torch.save(common, directory / "common.pt")


def test_bad_megatron_input_is_named_before_writing(make_hf_model, tmp_path):
    _, hf_dir = make_hf_model("llama", **GQA)
    ckpt = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    out = tmp_path / "out"

    def refused(megatron: Path, match: str, hf: Path = hf_dir) -> None:
        with pytest.raises(CheckpointError, match=match):
            convert(ConvertConfig(hf=hf, megatron=megatron, out=out))
        assert not out.exists()

    refused(tmp_path / "nothing", "not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"no latest_checkpointed_iteration.txt \(expected a Megatron-LM checkpoint root")
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "lg", tp=2, pp=2, megatron_format="legacy"))
    for rank in (tmp_path / "lg" / "iter_0000000" / "mp_rank_01_001").iterdir():
        rank.unlink()
    (tmp_path / "lg" / "iter_0000000" / "mp_rank_01_001").rmdir()
    refused(tmp_path / "lg", r"ranks \['mp_rank_01_001'\] are missing \(found 3 rank directories of a tp=2, pp=2")
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "td", tp=2))
    directory = tmp_path / "td" / "iter_0000000"
    rewrite_args(directory, num_experts=8, swiglu=False)
    refused(
        tmp_path / "td",
        r"args.swiglu=False \(llmflow reads a SwiGLU feed-forward.*args.num_experts=8 "
        r"where .*config.json has a dense model",
    )
    rewrite_args(directory, num_experts=None, swiglu=True)
    _, other = make_hf_model("llama", **{**GQA, "num_hidden_layers": 2})
    refused(tmp_path / "td", r"args.num_layers=4 where .*config.json has 2", hf=other)
    (tmp_path / "td" / "latest_checkpointed_iteration.txt").write_text("7")
    refused(tmp_path / "td", r"names iteration 7, but .*iter_0000007 does not exist")
    with pytest.raises(ValueError, match="give one output: --out"):
        ExportConfig(ckpt=ckpt)
    with pytest.raises(CheckpointError, match=r"--pp 3: the model's 4 layers do not split evenly"):
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "pp3", pp=3))
    assert not (tmp_path / "pp3").exists()


def test_biases_megatron_has_no_place_for_are_refused_before_writing(make_hf_model, tmp_path):
    _, plain = make_hf_model("qwen3", head_dim=24, **GQA)
    _, biased = make_hf_model("qwen3", head_dim=24, attention_bias=True, **GQA)
    message = r"biases on o_proj \(config.json attention_bias/mlp_bias\), which Megatron's layout \(q/k/v biases only\)"
    with pytest.raises(CheckpointError, match=message):
        export(ExportConfig(ckpt=convert(ConvertConfig(hf=biased, out=tmp_path / "biased")), megatron=tmp_path / "m"))
    assert not (tmp_path / "m").exists()
    export(ExportConfig(ckpt=convert(ConvertConfig(hf=plain, out=tmp_path / "plain")), megatron=tmp_path / "m"))
    with pytest.raises(CheckpointError, match=message):
        convert(ConvertConfig(hf=biased, megatron=tmp_path / "m", out=tmp_path / "back"))
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}])
def test_rotary_scalings_megatron_args_do_not_carry_are_refused(rope, make_hf_model, tmp_path):
    """Megatron-LM's GPT arguments carry Llama 3's rotary scaling alone (use_rope_scaling): a
    linear or YaRN scaling of plain attention is refused, not written as plain rotary."""
    _, model = make_hf_model("llama", rope_parameters={"rope_theta": 10000.0, **rope}, **GQA)
    ckpt = convert(ConvertConfig(hf=model, out=tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=f"llama rotates with rope_type '{rope['rope_type']}', which llmflow's "
                                              r"Megatron arguments do not carry \(plain rotary, or Llama 3's"):
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "m"))
    assert not (tmp_path / "m").exists()


def test_hybrid_linear_attention_models_are_refused_in_one_line(make_hf_model, tmp_path):
    """Qwen3.5's Gated DeltaNet layers and gated attention have no place in llmflow's Megatron
    layout: export and import refuse in one line naming why, before writing anything."""
    from test_qwen3_next import CASES

    family, overrides = CASES["qwen3_5_text"]
    _, hybrid = make_hf_model(family, **overrides)
    ckpt = convert(ConvertConfig(hf=hybrid, out=tmp_path / "ckpt"))
    reason = (
        r"qwen3_5_text has 3 Gated DeltaNet \(linear attention\) layers and gated attention, which llmflow's "
        r"Megatron layout does not map \(it holds attention and MLP layers only\)"
    )
    with pytest.raises(CheckpointError, match=f"^--megatron: {reason}$"):
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "m"))
    assert not (tmp_path / "m").exists()
    with pytest.raises(SystemExit, match=f"^llmflow export: --megatron: {reason}$"):
        main(["export", "--ckpt", str(ckpt), "--megatron", str(tmp_path / "m")])
    _, plain = make_hf_model("llama", **GQA)
    export(ExportConfig(ckpt=convert(ConvertConfig(hf=plain, out=tmp_path / "plain")), megatron=tmp_path / "m"))
    with pytest.raises(
        CheckpointError, match=f"^--megatron {re.escape(str(tmp_path / 'm' / 'iter_0000000'))}: {reason}$"
    ):
        convert(ConvertConfig(hf=hybrid, megatron=tmp_path / "m", out=tmp_path / "back"))
    assert not (tmp_path / "back").exists()


def test_optimizer_and_rng_state_are_skipped_and_said(make_hf_model, tmp_path, capsys):
    _, hf_dir = make_hf_model("llama", **GQA)
    ckpt = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "lg", megatron_format="legacy"))
    rank_file = tmp_path / "lg" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_pickled(rank_file)
    state |= {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}, "rng_state": [{"random_rng_state": None}]}
    torch.save(state, rank_file)
    main(["convert", "--hf", str(hf_dir), "--megatron", str(tmp_path / "lg"), "--out", str(tmp_path / "back")])
    assert read_manifest(tmp_path / "back")["megatron"]["skipped"] == ["optimizer", "rng_state"]
    assert "not read: optimizer, rng_state" in capsys.readouterr().out


# Tiny mixtures of experts: 4 experts of width 32, 2 per token, 4 layers of GQA attention.
MOE = {"num_experts_per_tok": 2, "head_dim": 16, **GQA}
MOE_MODELS = {
    # a dense layer among MoE layers (megatron-core stores each layer under its own keys),
    # per-head q/k norms, top-k weights renormalised
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    # a shared expert with its sigmoid gate, q/k/v biases, top-k weights as the softmax gives them
    "qwen2_moe": (
        "qwen2_moe",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "intermediate_size": 32}),
}


@pytest.fixture(params=list(MOE_MODELS))
def moe_model(request, make_hf_model, tmp_path):
    """A tiny mixture-of-experts model with a tokenizer, and its llmflow checkpoint."""
    family, extra = MOE_MODELS[request.param]
    _, hf_dir = make_hf_model(family, **MOE, **extra)
    add_tokenizer(hf_dir)
    return hf_dir, convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))


def assert_comes_back(hf_dir: Path, megatron: Path, tmp_path: Path, name: str = "back") -> None:
    """Import ``megatron`` and export it to Hugging Face files equal to ``hf_dir``'s, bit for bit."""
    back = convert(ConvertConfig(hf=hf_dir, megatron=megatron, out=tmp_path / name))
    original, exported = hf_tensors(hf_dir), hf_tensors(export(ExportConfig(ckpt=back, out=tmp_path / f"{name}-hf")))
    assert sorted(exported) == sorted(original)
    for tensor_name, tensor in original.items():
        assert torch.equal(exported[tensor_name], tensor), tensor_name


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_moe_export_then_import_is_bit_exact(moe_model, tmp_path, fmt):
    hf_dir, ckpt = moe_model
    megatron = tmp_path / "megatron"
    main(
        [
            "export",
            "--ckpt",
            str(ckpt),
            "--megatron",
            str(megatron),
            "--tp",
            "2",
            "--pp",
            "2",
            "--ep",
            "2",
            "--megatron-format",
            fmt,
        ]
    )
    if fmt == "legacy":  # Megatron-LM's names: mp_rank_{tp:02d}_{pp:03d}_{ep:03d}
        ranks = sorted(p.parent.name for p in (megatron / "iter_0000000").glob("mp_rank_*/model_optim_rng.pt"))
        assert ranks == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    assert_comes_back(hf_dir, megatron, tmp_path)


def stored_shapes(directory: Path) -> dict[str, tuple[int, ...] | None]:
    """Each key of a torch_dist checkpoint with its global shape (None: an object)."""
    stored = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key: None if isinstance(v, BytesStorageMetadata) else tuple(v.size) for key, v in stored.items()}


def test_moe_torch_dist_is_laid_out_as_megatron_core_saves(make_hf_model, tmp_path):
    """The keys and shapes megatron-core 0.16.1's MoE GPTModel (router, SequentialMLP or
    TEGroupedMLP experts, shared expert with its gate) gives its sharded state dict."""
    family, extra = MOE_MODELS["qwen2_moe"]
    _, hf_dir = make_hf_model(family, **MOE, **extra)
    export(ExportConfig(ckpt=convert(ConvertConfig(hf=hf_dir, out=tmp_path / "q2")), megatron=tmp_path / "q2m", ep=2))
    stored = stored_shapes(tmp_path / "q2m" / "iter_0000000")
    layers = {key: shape for key, shape in stored.items() if key.startswith("decoder.layers.") and shape}
    assert layers == {  # every layer routes: stacked on dim 0, the experts on dim 1
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (4, 64),
        "decoder.layers.self_attention.linear_qkv.weight": (4, 128, 64),
        "decoder.layers.self_attention.linear_qkv.bias": (4, 128),
        "decoder.layers.self_attention.linear_proj.weight": (4, 64, 64),
        "decoder.layers.pre_mlp_layernorm.weight": (4, 64),  # the Transformer Engine spec's MoE layer
        "decoder.layers.mlp.router.weight": (4, 4, 64),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (4, 4, 64, 64),  # each expert's gate then up
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (4, 4, 64, 32),
        "decoder.layers.mlp.shared_experts.linear_fc1.weight": (4, 96, 64),
        "decoder.layers.mlp.shared_experts.linear_fc2.weight": (4, 64, 48),
        "decoder.layers.mlp.shared_experts.gate_weight": (4, 1, 64),
    }
    extra_states = sorted(key for key, shape in stored.items() if shape is None)
    assert len(extra_states) == 4 * (4 + 2 * 4)  # attention's 2, the shared expert's 2, 2 per routed expert
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_3.2_4.4" in extra_states
    assert "decoder.layers.mlp.shared_experts.linear_fc2._extra_state/shard_3_4" in extra_states
    args = load_pickled(tmp_path / "q2m" / "iter_0000000" / "common.pt")["args"]
    assert (
        vars(args).items()
        >= {
            "num_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 32,
            "moe_shared_expert_intermediate_size": 48,
            "moe_shared_expert_gate": True,
            "moe_layer_freq": 1,
            "moe_grouped_gemm": False,
            "moe_router_pre_softmax": True,
            "moe_router_score_function": "softmax",
            "moe_router_topk_scaling_factor": None,
            "expert_model_parallel_size": 2,
            "transformer_impl": "transformer_engine",
            "add_qkv_bias": True,
        }.items()
    )

    family, extra = MOE_MODELS["qwen3_moe"]  # layer 1 dense: each layer under its own keys
    _, hf_dir = make_hf_model(family, **MOE, **extra)
    ckpt = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "q3"))
    specs = (("transformer_engine", "pre_mlp_layernorm.weight"), ("local", "mlp.linear_fc1.layer_norm_weight"))
    for spec, norm in specs:
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / spec, megatron_spec=spec, moe_grouped_gemm=True))
        stored = stored_shapes(tmp_path / spec / "iter_0000000")
        assert stored[f"decoder.layers.0.{norm}"] == (64,) and stored["decoder.layers.0.mlp.router.weight"] == (4, 64)
        assert stored["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == (4, 64, 64)
        assert stored["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"] == (64,)  # the dense layer, in either spec
        assert stored["decoder.layers.1.mlp.linear_fc1.weight"] == (192, 64)
        assert stored["decoder.layers.2.self_attention.q_layernorm.weight"] == (16,)
        assert not any(key.startswith("decoder.layers.self_attention") for key in stored)
        assert stored["decoder.layers.2.mlp.experts.experts.linear_fc2._extra_state/shard_3_4"] is None
        assert stored["decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1"] is None
        args = load_pickled(tmp_path / spec / "iter_0000000" / "common.pt")["args"]
        assert (args.moe_layer_freq, args.moe_router_pre_softmax, args.moe_grouped_gemm) == ([1, 0, 1, 1], False, True)
        assert (args.transformer_impl, args.moe_shared_expert_intermediate_size) == (spec, None)
        assert args.ffn_hidden_size == 96  # the dense layer's width
    assert_comes_back(hf_dir, tmp_path / "local", tmp_path)


def test_moe_legacy_rank_files_hold_their_local_experts(make_hf_model, tmp_path):
    """ep=2 without pipeline stages: mp_rank_{tp:02d}_{ep:03d}, each with its 2 of the 4 experts
    numbered from 0, as SequentialMLP (the default) or TEGroupedMLP's GroupedLinear names them;
    read back with args, and without (the files themselves tell expert from pipeline ranks)."""
    family, extra = MOE_MODELS["mixtral"]
    _, hf_dir = make_hf_model(family, **MOE, **extra)
    ckpt = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    gate = hf_tensors(hf_dir)["model.layers.3.block_sparse_moe.experts.3.w1.weight"]
    for grouped, expert_fc1, norms in (
        (
            False,
            "mlp.experts.local_experts.1.linear_fc1.weight",
            ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
        ),
        (
            True,
            "mlp.experts.linear_fc1.weight1",
            ("self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight"),
        ),
    ):
        megatron = tmp_path / f"grouped-{grouped}"
        export(ExportConfig(ckpt=ckpt, megatron=megatron, ep=2, megatron_format="legacy", moe_grouped_gemm=grouped))
        directory = megatron / "iter_0000000"
        assert sorted(p.name for p in directory.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
        state = load_pickled(directory / "mp_rank_00_001" / "model_optim_rng.pt")
        model = state["model"]
        assert state["args"].transformer_impl == ("transformer_engine" if grouped else "local")
        assert torch.equal(model[f"decoder.layers.3.{expert_fc1}"][:32], gate)  # global expert 3: gate rows, then up
        assert not any(".local_experts.2." in key or key.endswith("weight2") for key in model)
        assert {
            f"decoder.layers.0.{norms[0]}",
            f"decoder.layers.0.{norms[1]}",
            "decoder.layers.0.mlp.router.weight",
            "embedding.word_embeddings.weight",
        } <= set(model)
        assert_comes_back(hf_dir, megatron, tmp_path, f"back-{grouped}")
    for rank in directory.iterdir():  # no args: every file holds the embedding, so the ranks are expert ranks
        state = load_pickled(rank / "model_optim_rng.pt")
        state["args"] = None
        torch.save(state, rank / "model_optim_rng.pt")
    assert_comes_back(hf_dir, megatron, tmp_path, "back-no-args")


def test_bad_moe_input_is_named_before_writing(make_hf_model, tmp_path):
    family, extra = MOE_MODELS["qwen3_moe"]
    _, hf_dir = make_hf_model(family, **MOE, **extra)
    _, eight = make_hf_model(family, **MOE, **{**extra, "num_experts": 8})
    ckpt = convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))
    out = tmp_path / "out"

    def refused(megatron: Path, match: str, hf: Path = hf_dir) -> None:
        with pytest.raises(CheckpointError, match=match):
            convert(ConvertConfig(hf=hf, megatron=megatron, out=out))
        assert not out.exists()

    with pytest.raises(CheckpointError, match=r"^--ep 3: the model's 4 experts do not divide among 3 expert-parallel "):
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "ep3", ep=3))
    _, dense = make_hf_model("llama", **GQA)
    with pytest.raises(CheckpointError, match=r"^--ep 2: the model \(llama\) has no experts"):
        export(
            ExportConfig(ckpt=convert(ConvertConfig(hf=dense, out=tmp_path / "dense")), megatron=tmp_path / "ep3", ep=2)
        )
    assert not (tmp_path / "ep3").exists()

    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "td", ep=2))
    directory = tmp_path / "td" / "iter_0000000"
    refused(
        tmp_path / "td",
        rf"^--megatron {directory} \(torch_dist\): not the model of .*config.json: "
        r"args.num_experts=4 where .*config.json has num_experts=8$",
        hf=eight,
    )
    rewrite_args(directory, moe_router_score_function="sigmoid", moe_layer_freq=1)
    refused(
        tmp_path / "td",
        r"args.moe_router_score_function='sigmoid' where .* routes with "
        r"moe_router_score_function='softmax' \(softmax router, norm_topk_prob=True\); "
        r"args.moe_layer_freq=1 \(MoE layers \[1, 1, 1, 1\]\) where .* has "
        r"MoE layers \[1, 0, 1, 1\]",
    )

    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "lg", ep=2, megatron_format="legacy"))
    directory = tmp_path / "lg" / "iter_0000000"
    for rank in directory.iterdir():
        state = load_pickled(rank / "model_optim_rng.pt")
        state["args"] = None
        torch.save(state, rank / "model_optim_rng.pt")
    refused(
        tmp_path / "lg",
        rf"^--megatron {directory}: decoder.layers.0.mlp.router.weight holds 4 experts where "
        r".*config.json has num_experts=8$",
        hf=eight,
    )
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "lg2", ep=2, megatron_format="legacy"))
    for rank in (tmp_path / "lg2" / "iter_0000000" / "mp_rank_00_001").iterdir():
        rank.unlink()
    (tmp_path / "lg2" / "iter_0000000" / "mp_rank_00_001").rmdir()
    refused(
        tmp_path / "lg2",
        r"ranks \['mp_rank_00_001'\] are missing \(found 1 rank directories of a tp=1, pp=1, "
        r"ep=2 layout\)",
    )


# A tiny DeepSeek-V3 (test_mla's moe_yarn: MLA with q_a_proj/q_b_proj, YaRN, layer 0 dense, then the
# sigmoid router with a nonzero correction bias, 2 ungated shared experts) with what megatron-core
# computes as transformers does: the latent norms' eps, groups scored by their best 2.
DEEPSEEK = {"rms_norm_eps": 1e-6, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}


@pytest.fixture
def deepseek(make_hf_model, tmp_path):
    """The tiny DeepSeek-V3 with a tokenizer, and its llmflow checkpoint."""
    _, hf_dir = hf_model(make_hf_model, "moe_yarn", **DEEPSEEK)
    add_tokenizer(hf_dir)
    return hf_dir, convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt"))


def test_mla_rotary_rows_pair_as_megatron_core_gathers_them():
    """megatron-core's MLA gathers each block's rotary rows even before odd
    (``_apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``): a half-split model's rows
    are stored so that the gather gives its halves back; an interleaved model's as they are."""
    config = ModelConfig.from_hf(
        {
            "model_type": "deepseek_v3",
            "vocab_size": 96,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "q_lora_rank": 6,
            "kv_lora_rank": 4,
            "qk_nope_head_dim": 3,
            "qk_rope_head_dim": 4,
            "v_head_dim": 5,
            "rope_interleave": False,
            "rms_norm_eps": 1e-6,
        }
    )
    attention = Attention.of(config)
    q_b = torch.arange(2 * 7.0)[:, None].expand(-1, 6)  # per head: 3 rows without rotary, then 4 rotary rows
    stored = fuse(Q_UP, [q_b], attention)
    assert stored[:, 0].tolist() == [0, 1, 2, 3, 5, 4, 6, 7, 8, 9, 10, 12, 11, 13]  # halves (3, 4), (5, 6) paired
    gathered = stored.view(2, 7, 6)[:, 3:]
    assert torch.equal(torch.cat([gathered[:, 0::2], gathered[:, 1::2]], dim=1), q_b.view(2, 7, 6)[:, 3:])
    kv_a = torch.randn(8, 32)  # the latent's 4 rows, then the shared rotary key's 4
    assert torch.equal(fuse(KV_DOWN, [kv_a], attention)[[0, 1, 2, 3, 4, 6, 5, 7]], kv_a)
    for name, tensor in ((Q_UP, q_b), (KV_DOWN, kv_a)):
        assert torch.equal(unfuse(name, fuse(name, [tensor], attention), attention)[0], tensor)
    interleaved = Attention.of(replace(config, rope_interleave=True))
    assert torch.equal(fuse(Q_UP, [q_b], interleaved), q_b)


def test_mla_torch_dist_is_laid_out_as_megatron_core_saves(deepseek, tmp_path):
    """The keys and shapes of megatron-core 0.16.1's MLA GPTModel in either spec (the latent norms
    fused into the up projections or modules of their own), the expert bias in fp32 in a bf16
    export, and the args megatron-core builds MLA, YaRN and the sigmoid router from."""
    _, ckpt = deepseek
    te, local = "transformer_engine", "local"
    norms = {
        te: (
            "input_layernorm.weight",
            "self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight",
            "mlp.linear_fc1.layer_norm_weight",
        ),
        local: (
            "input_layernorm.weight",
            "self_attention.q_layernorm.weight",
            "self_attention.kv_layernorm.weight",
            "pre_mlp_layernorm.weight",
        ),
    }
    for spec in (te, local):
        export(ExportConfig(ckpt=ckpt, megatron=tmp_path / spec, megatron_spec=spec, dtype="bfloat16"))
        directory = tmp_path / spec / "iter_0000000"
        stored = stored_shapes(directory)
        dense = {
            key.removeprefix("decoder.layers.0."): shape
            for key, shape in stored.items()
            if key.startswith("decoder.layers.0.") and shape
        }
        assert dense == dict(zip(norms[spec], [(64,), (24,), (16,), (64,)])) | {
            "self_attention.linear_q_down_proj.weight": (24, 64),
            "self_attention.linear_q_up_proj.weight": (4 * 20, 24),  # per head 12 rows without rotary, then 8
            "self_attention.linear_kv_down_proj.weight": (16 + 8, 64),  # the latent, then the rotary key
            "self_attention.linear_kv_up_proj.weight": (4 * (12 + 10), 16),  # per head its key part, then its value
            "self_attention.linear_proj.weight": (64, 4 * 10),
            "mlp.linear_fc1.weight": (192, 64),
            "mlp.linear_fc2.weight": (64, 96),
        }
        assert stored["decoder.layers.1.pre_mlp_layernorm.weight"] == (64,)  # a MoE layer's, in either spec
        assert stored["decoder.layers.2.mlp.router.expert_bias"] == (8,)
        assert stored["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (128, 64)
        assert "decoder.layers.2.mlp.shared_experts.gate_weight" not in stored  # ungated
        assert stored["decoder.layers.0.self_attention.linear_q_down_proj._extra_state/shard_0_1"] is None
        assert stored["decoder.layers.2.self_attention.linear_kv_up_proj._extra_state/shard_0_1"] is None
        metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        assert metadata["decoder.layers.2.mlp.router.expert_bias"].properties.dtype == torch.float32
        assert metadata["decoder.layers.2.mlp.router.weight"].properties.dtype == torch.bfloat16
    args = load_pickled(tmp_path / te / "iter_0000000" / "common.pt")["args"]
    assert (
        vars(args).items()
        >= {
            "multi_latent_attention": True,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_head_dim": 12,
            "qk_pos_emb_head_dim": 8,
            "v_head_dim": 10,
            "kv_channels": 10,
            "qk_layernorm": True,
            "rope_type": "yarn",
            "rotary_scaling_factor": 8.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 16,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "rotary_interleaved": False,
            "add_qkv_bias": False,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 2,
            "moe_router_group_topk": 1,
            "moe_router_topk_scaling_factor": 2.5,
            "moe_router_topk": 2,
            "moe_shared_expert_intermediate_size": 64,
            "moe_shared_expert_gate": False,
            "moe_layer_freq": [0, 1, 1],
            "layernorm_epsilon": 1e-6,
        }.items()
    )


@pytest.mark.parametrize("spec", ["transformer_engine", "local"])
def test_mla_legacy_files_split_the_down_projections_as_the_spec_does(deepseek, tmp_path, spec):
    """tp=2 legacy files: the local spec's ColumnParallelLinear down projections hold half the
    latent rows on each rank, the Transformer Engine spec's (TELinear, duplicated) all of them;
    each reads back bit-exact, as torch_dist does."""
    hf_dir, ckpt = deepseek
    megatron = tmp_path / "legacy"
    export(ExportConfig(ckpt=ckpt, megatron=megatron, tp=2, ep=2, megatron_format="legacy", megatron_spec=spec))
    model = load_pickled(megatron / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt")["model"]
    rows = 24 if spec == "transformer_engine" else 12
    assert model["decoder.layers.1.self_attention.linear_q_down_proj.weight"].shape == (rows, 64)
    assert model["decoder.layers.1.self_attention.linear_kv_up_proj.weight"].shape == (2 * 22, 16)  # 2 of 4 heads
    assert_comes_back(hf_dir, megatron, tmp_path)
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "dist", tp=2, ep=2, megatron_spec=spec))
    assert_comes_back(hf_dir, tmp_path / "dist", tmp_path, "back-dist")


def test_bad_mla_and_sigmoid_router_input_is_named_before_writing(deepseek, make_hf_model, tmp_path):
    hf_dir, ckpt = deepseek
    export(ExportConfig(ckpt=ckpt, megatron=tmp_path / "td"))
    directory = tmp_path / "td" / "iter_0000000"
    out = tmp_path / "out"

    def refused(match: str, **changes) -> None:
        common = load_pickled(directory / "common.pt")
        rewrite_args(directory, **changes)
        with pytest.raises(CheckpointError, match=match):
            convert(ConvertConfig(hf=hf_dir, megatron=tmp_path / "td", out=out))
        assert not out.exists()
        torch.save(common, directory / "common.pt")

    refused(r"args.multi_latent_attention=False where .*config.json has kv_lora_rank=16", multi_latent_attention=False)
    refused(
        r"args.q_lora_rank=32 where .*config.json implies 24; args.rope_type='rope' where .* implies 'yarn'",
        q_lora_rank=32,
        rope_type="rope",
    )
    refused(
        r"args.moe_router_group_topk=2 where .*config.json routes with moe_router_group_topk=1 \(sigmoid router",
        moe_router_group_topk=2,
        moe_router_num_groups=4,
    )
    refused(
        r"args.moe_router_enable_expert_bias=False where .* routes with moe_router_enable_expert_bias=True",
        moe_router_enable_expert_bias=False,
    )
    refused(r"args.moe_shared_expert_gate is set \(llmflow's shared experts are ungated\)", moe_shared_expert_gate=True)
    _, plain = make_hf_model("deepseek_v3", **{**CASES["moe_yarn"], **DEEPSEEK, "rope_parameters": None})
    with pytest.raises(CheckpointError, match=r"args.rope_type='yarn' where .*config.json implies 'rope'"):
        convert(ConvertConfig(hf=plain, megatron=tmp_path / "td", out=out))
    assert not out.exists()


def test_what_megatron_core_computes_otherwise_is_refused(deepseek):
    """megatron-core's MLA rounds YaRN's correction range, computes its attention factor and has one
    norm eps; its sigmoid router renormalises whenever it chooses more than one expert."""
    hf = json.loads((deepseek[0] / "config.json").read_text())
    yarn = hf["rope_parameters"]
    assert unmapped_layers(ModelConfig.from_hf(hf)) is None
    refused = {
        "truncate=false": {"rope_parameters": {**yarn, "truncate": False}},
        "sets YaRN's attention_factor": {"rope_parameters": {**yarn, "attention_factor": 1.2}},
        "sets YaRN's mscale_all_dim without mscale": {"rope_parameters": {**yarn, "mscale": None}},
        "does not renormalise the weights of its 2 chosen experts": {"norm_topk_prob": False},
        "renormalises the weights of its 1 chosen experts": {"num_experts_per_tok": 1, "n_group": 1},
        "scores a group of experts by its best 2 (megatron-core: by its best num_experts_per_tok // topk_group = "
        "1 // 1)": {"num_experts_per_tok": 1, "norm_topk_prob": False},
    }
    for reason, changes in refused.items():
        assert reason in (unmapped_layers(ModelConfig.from_hf({**hf, **changes})) or ""), reason
    one = {"num_experts_per_tok": 1, "norm_topk_prob": False, "n_group": 1}
    assert unmapped_layers(ModelConfig.from_hf({**hf, **one})) is None
