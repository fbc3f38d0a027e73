"""Carried tensors (llmflow.weights.carried): what a checkpoint holds beside the decoder — a
multimodal Qwen3.5's vision tower, Qwen3-Next's and Qwen3.5's multi-token prediction layers —
goes through convert, training and export bit for bit (names, dtypes, bytes) with the
original config.json, so the export loads in the original transformers class with its real
vision weights; anything else with no place in the decoder is still refused.

transformers' Qwen3-Next and Qwen3.5 classes have no MTP module (``_keys_to_ignore_on_load_unexpected
= [r"^mtp.*"]``) and save none, so the tests add ``mtp.*`` tensors named as vLLM's Qwen3-Next MTP
loader reads them from the published checkpoints (``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and one full-attention decoder layer ``mtp.layers.0.*``),
in bfloat16 beside an fp32 model, so that a dtype changed on the way would show."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert import hf_tensors
from test_qwen3_next import EXPERTS, HYBRID, MULTIMODAL_VISION

from llmflow.cli import main
from llmflow.data.tokenize_instruction import InstructionTokenizeConfig, tokenize_instruction
from llmflow.train.config import TrainConfig
from llmflow.train.loop import train
from llmflow.weights import CheckpointError, latest_step_dir, read_meta
from llmflow.weights.carried import CARRIED_DIR
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.hf import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from llmflow.weights.tokenizer_files import copy_tokenizer_files


@pytest.fixture(scope="module")
def sample(sample_assets) -> tuple[Path, int]:
    """The sample's model directory (its tokenizer) and vocabulary size."""
    model = sample_assets() / "model"
    return model, json.loads((model / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def sft(sample, tmp_path_factory) -> Path:
    model, _ = sample
    return tokenize_instruction(InstructionTokenizeConfig(
        input=[model.parent / "instruct" / "alpaca.jsonl"], tokenizer=model, out=tmp_path_factory.mktemp("sft") / "sft",
        format="alpaca", seq_length=64, pack=True))


def add_mtp(directory: Path, prefix: str, layer: int) -> list[str]:
    """Multi-token prediction tensors in bfloat16 beside the checkpoint's own: the fusion
    projection and norms, and a copy of decoder layer ``layer`` (``{prefix}layers.{layer}.*``)
    as ``mtp.layers.0.*``; in a shard of their own when the checkpoint is sharded. Their names."""
    stored = hf_tensors(directory)
    hidden = stored[f"{prefix}norm.weight"].shape[0]
    g = torch.Generator().manual_seed(7)
    mtp = {f"mtp.{name}": torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in (
        ("fc.weight", (hidden, 2 * hidden)), ("pre_fc_norm_embedding.weight", (hidden,)),
        ("pre_fc_norm_hidden.weight", (hidden,)), ("norm.weight", (hidden,)))}
    layer_prefix = f"{prefix}layers.{layer}."
    mtp |= {"mtp.layers.0." + n.removeprefix(layer_prefix): t.to(torch.bfloat16) + 0.5
            for n, t in stored.items() if n.startswith(layer_prefix)}
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        save_file(mtp, directory / "model-mtp.safetensors", metadata={"format": "pt"})
        contents = json.loads(index.read_text())
        contents["weight_map"] |= dict.fromkeys(mtp, "model-mtp.safetensors")
        index.write_text(json.dumps(contents))
    else:
        save_file(load_file(directory / SAFETENSORS_SINGLE) | mtp, directory / SAFETENSORS_SINGLE, metadata={"format": "pt"})
    return sorted(mtp)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def assert_same_checkpoint(exported: Path, original: Path) -> None:
    """Every tensor of ``original`` in ``exported`` bit for bit, nothing else, and its config.json."""
    got, want = hf_tensors(exported), hf_tensors(original)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_bit_equal(got[name], tensor, name)
    assert json.loads((exported / "config.json").read_text()) == json.loads((original / "config.json").read_text())


def assert_trained(exported: Path, original: Path, carried: list[str]) -> None:
    """The carried tensors of ``original`` bit-equal in ``exported``, every other one changed."""
    got, want = hf_tensors(exported), hf_tensors(original)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        if name in carried:
            assert_bit_equal(got[name], tensor, name)
        else:
            assert not torch.equal(got[name], tensor), f"{name} was not trained"
    assert json.loads((exported / "config.json").read_text()) == json.loads((original / "config.json").read_text())


def finetune(model: Path, out: Path, sft: Path, **overrides) -> Path:
    run = TrainConfig.model_validate({"model": str(model), "out": str(out), "steps": 2, "micro_batch_size": 2,
                                      "global_batch_size": 2, "data": {"kind": "sft", "paths": [str(sft)]},
                                      "optim": {"lr": 1e-2}, "log_interval": 1, **overrides})
    train(run)
    return run.out


@pytest.fixture(scope="module")
def multimodal(make_hf_model, sample) -> tuple[torch.nn.Module, Path, list[str]]:
    """A Qwen3.5 as published (``Qwen3_5ForConditionalGeneration``, a tiny vision tower) with
    MTP layers and the sample's tokenizer; its carried tensors' names."""
    tokenizer, vocab = sample
    hf, path = make_hf_model("qwen3_5", text_config={**HYBRID, "vocab_size": vocab}, vision_config=MULTIMODAL_VISION)
    copy_tokenizer_files(tokenizer, path)
    mtp = add_mtp(path, "model.language_model.", 3)
    return hf, path, sorted(n for n in hf_tensors(path) if n.startswith("model.visual.")) + mtp


def test_multimodal_qwen3_5_keeps_its_vision_tower_and_mtp_layers(multimodal, sft, tmp_path, capsys):
    from transformers import Qwen3_5ForConditionalGeneration

    hf, path, carried = multimodal
    visual = [n for n in carried if n.startswith("model.visual.")]
    ckpt = tmp_path / "ckpt"
    main(["convert", "--hf", str(path), "--out", str(ckpt)])
    line = f"carried, not trained: model.visual.* ({len(visual)} tensors), mtp.* ({len(carried) - len(visual)} tensors)"
    assert line in capsys.readouterr().out
    counts = {"model.visual.": len(visual), "mtp.": len(carried) - len(visual)}
    assert read_meta(latest_step_dir(ckpt)).carried == counts
    assert sorted(hf_tensors(ckpt / CARRIED_DIR)) == carried

    exported = export(ExportConfig(ckpt=ckpt, out=tmp_path / "hf"))
    assert_same_checkpoint(exported, path)
    theirs, info = Qwen3_5ForConditionalGeneration.from_pretrained(exported, dtype=torch.float32,
                                                                   attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    vision = dict(theirs.model.visual.named_parameters())
    assert vision and len(vision) == len(dict(hf.model.visual.named_parameters()))
    for name, param in hf.model.visual.named_parameters():
        assert torch.equal(vision[name], param), name
    ids = torch.randint(0, hf.config.text_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs.eval()(input_ids=ids).logits, hf(input_ids=ids).logits)

    run = finetune(ckpt, tmp_path / "run", sft)
    assert line in capsys.readouterr().out
    assert read_meta(latest_step_dir(run)).carried == counts
    assert_trained(export(ExportConfig(ckpt=run, out=tmp_path / "trained")), path, carried)


@pytest.fixture(scope="module")
def qwen3_next(make_hf_model, sample) -> tuple[Path, list[str]]:
    """A Qwen3-Next MoE saved in shards, its MTP layers in a shard of their own."""
    tokenizer, vocab = sample
    _, path = make_hf_model("qwen3_next", save_kwargs={"max_shard_size": "200KB"},
                            **{**HYBRID, **EXPERTS, "vocab_size": vocab})
    copy_tokenizer_files(tokenizer, path)
    assert (path / SAFETENSORS_INDEX).is_file()
    return path, add_mtp(path, "model.", 3)


def test_qwen3_next_mtp_layers_through_convert_and_training_from_the_hf_directory(qwen3_next, sft, tmp_path):
    path, mtp = qwen3_next
    ckpt = convert(ConvertConfig(hf=path, out=tmp_path / "ckpt"))
    assert_same_checkpoint(export(ExportConfig(ckpt=ckpt, out=tmp_path / "hf", max_shard_mb=0.1)), path)

    run = finetune(path, tmp_path / "run", sft)  # straight from the Hugging Face directory
    assert sorted(hf_tensors(run / CARRIED_DIR)) == mtp
    assert_trained(export(ExportConfig(ckpt=run, out=tmp_path / "trained")), path, mtp)


def test_a_lora_run_exports_its_bases_carried_tensors(qwen3_next, sft, tmp_path):
    path, mtp = qwen3_next
    ckpt = convert(ConvertConfig(hf=path, out=tmp_path / "ckpt"))
    run = finetune(ckpt, tmp_path / "lora", sft, lora={"rank": 4, "alpha": 8})
    assert not (run / CARRIED_DIR).exists() and read_meta(latest_step_dir(run)).carried == {}
    merged = hf_tensors(export(ExportConfig(ckpt=run, out=tmp_path / "merged", merge_lora=True)))
    original = hf_tensors(path)
    assert sorted(merged) == sorted(original)
    for name in mtp:
        assert_bit_equal(merged[name], original[name], name)
    peft = export(ExportConfig(ckpt=run, out=tmp_path / "peft"))
    assert not any(n.startswith("mtp.") for n in load_file(peft / "adapter_model.safetensors"))


def test_a_missing_carried_folder_is_refused_before_export_writes(qwen3_next, tmp_path):
    path, _ = qwen3_next
    ckpt = convert(ConvertConfig(hf=path, out=tmp_path / "ckpt"))
    shutil.rmtree(ckpt / CARRIED_DIR)
    with pytest.raises(CheckpointError, match=r"counts carried tensors \(mtp\.\* \(\d+ tensors\)\), but .*carried is missing"):
        export(ExportConfig(ckpt=ckpt, out=tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("family, name", [("llama", "model.visual.patch_embed.proj.weight"),
                                          ("qwen3_5_text", "model.visul.patch_embed.proj.weight")])
def test_tensors_under_no_carried_prefix_are_still_refused(make_hf_model, tmp_path, family, name):
    """A text-only family carries nothing, and a misspelt prefix is no prefix: convert names the
    tensor and writes nothing."""
    _, path = make_hf_model(family, **(HYBRID if family == "qwen3_5_text" else {}))
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    save_file(load_file(path / SAFETENSORS_SINGLE) | {name: torch.zeros(4, 4)}, broken / SAFETENSORS_SINGLE,
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        convert(ConvertConfig(hf=broken, out=tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
