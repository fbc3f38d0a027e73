"""Megatron checkpoints made and read by megatron-core itself (``megatron_worker.py``, ranks on
CPU under gloo): llmflow's import of them computes megatron-core's logits (fp32, within
1e-5) from torch_dist and legacy files at tp=1 and at tp=2/pp=2, and a Hugging Face model
exported to torch_dist, loaded by megatron-core's ``dist_checkpointing.load`` (default
strictness) into a tp=2/pp=2 GPTModel, saved again by megatron-core and imported comes back
bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from forked_workers import run_forked
from test_convert import add_tokenizer, hf_tensors

from llmflow.weights import load_model
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export

TOLERANCE = 1e-5
SHAPES = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}

pytestmark = pytest.mark.slow


def run_worker(ranks: int, *args: str) -> None:
    """megatron_worker.py's main on ``ranks`` gloo ranks (forked with megatron-core imported);
    their output, beside the worker's --out, shown when it fails."""
    run_forked("megatron_worker:main", list(args), ranks, Path(args[args.index("--out") + 1]), {"OMP_NUM_THREADS": "1"},
               process_group=True)


def hf_config_dir(path: Path, family: str, tied: bool) -> Path:
    """A Hugging Face model directory holding only config.json (the converter reads no weights from it)."""
    path.mkdir()
    config = {**SHAPES, "model_type": family, "tie_word_embeddings": tied, "rope_theta": 10000.0,
              "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def llmflow_logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_model(checkpoint)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize(("family", "tied", "tp", "pp"), [("qwen2", True, 1, 1), ("llama", False, 2, 2)],
                         ids=["qwen2-tied-tp1", "llama-tp2-pp2"])
def test_import_computes_megatron_cores_logits(tmp_path, family, tied, tp, pp):
    hf = hf_config_dir(tmp_path / "hf", family, tied)
    made = tmp_path / "made"
    run_worker(tp * pp, "make", "--config", str(hf / "config.json"), "--tp", str(tp), "--pp", str(pp),
               "--iteration", "20", "--out", str(made), "--legacy")
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
