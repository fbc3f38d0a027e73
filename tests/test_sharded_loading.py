"""Sharded loading (``llmflow/weights/sharded_loading.py``): a training rank builds the model on
the meta device, shards it, and reads only its own shard of every weight. The weights, LoRA
adapters and RNG state come out bitwise as the whole-model load leaves them, in one process
and (slow: two forked gloo ranks) under dp=2 (FSDP2, an uneven vocabulary split), tp=2 and
ep=2, from a Hugging Face directory and from a training checkpoint; a rank reads its share."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from forked_workers import run_forked
from safetensors.torch import load_file, save_file

from llmflow.models import LoraConfig, apply_lora
from llmflow.weights import CheckpointError, load_model
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.hf import index_hf_tensors
from llmflow.weights.sharded_loading import load_sharded, meta_model, sharded_source

# 161 rows: FSDP2 splits the embedding 81 / 80 over two ranks.
MOE = {"vocab_size": 161, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "norm_topk_prob": True, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def moe_sources(make_hf_model, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny tied Qwen3-MoE as a Hugging Face directory and converted to a checkpoint."""
    _, hf = make_hf_model("qwen3_moe", **MOE)
    checkpoint = convert(ConvertConfig(hf=hf, out=tmp_path_factory.mktemp("moe-ckpt") / "ckpt"))
    return hf, checkpoint


def load_both(path: Path, lora: LoraConfig | None = None):
    """(whole-model load, sharded load, its report), each after seeding as ``setup`` does, and a
    draw of the default generator after each."""
    torch.manual_seed(3)
    whole, _ = load_model(path)
    if lora is not None:
        apply_lora(whole, lora, generator=torch.Generator().manual_seed(3))
    whole_draw = torch.rand(4)
    torch.manual_seed(3)
    source = sharded_source(path)
    sharded = meta_model(source)
    if lora is not None:
        apply_lora(sharded, lora)
    report = load_sharded(sharded, [sharded], source, torch.device("cpu"), 3 if lora is not None else None)
    return whole, sharded, report, whole_draw, torch.rand(4)


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])], ids=["full", "lora"])
@pytest.mark.parametrize("kind", ["hf", "checkpoint"])
def test_one_process_loads_the_whole_model_bitwise(moe_sources, kind, lora):
    hf, checkpoint = moe_sources
    whole, sharded, report, whole_draw, sharded_draw = load_both(hf if kind == "hf" else checkpoint, lora)
    want, got = dict(whole.named_parameters()), dict(sharded.named_parameters())
    assert list(got) == list(want)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert [k for k in got if got[k].requires_grad != want[k].requires_grad] == []
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight  # still tied
    assert torch.equal(sharded.model.inv_freq, whole.model.inv_freq)
    assert torch.equal(sharded_draw, whole_draw)  # LoRA dropout draws from the default generator
    if kind == "hf":  # every stored tensor once, one tensor (an expert, the embedding) at a time
        stored = index_hf_tensors(hf)
        assert report.bytes_read == sum(t.nbytes for t in stored.values())
        assert report.largest_read == max(t.nbytes for t in stored.values())


def test_a_lora_checkpoint_is_loaded_whole(tmp_path, moe_sources):
    step = tmp_path / "lora" / "step_00000001"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"hf_config": {}, "padded_vocab_size": 256, "lora": {"rank": 4, "alpha": 8}}')
    assert sharded_source(step) is None
    assert sharded_source(moe_sources[1]).checkpoint and not sharded_source(moe_sources[0]).checkpoint


def test_non_finite_weights_are_refused_naming_file_and_tensor(make_hf_model):
    _, path = make_hf_model("llama", seed=1)
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    source = sharded_source(path)
    model = meta_model(source)
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: tensor 'model.layers.1.mlp.up_proj.weight'")):
        load_sharded(model, [model], source, torch.device("cpu"))


@pytest.mark.slow
def test_ranks_load_their_shards_bitwise_and_read_their_share(moe_sources, tmp_path):
    """Two gloo ranks (one forked launch, every layout in turn): dp=2 (FSDP2; with LoRA and full
    checkpointing), tp=2, dp=2 x ep=2, from the Hugging Face directory and the checkpoint; then an
    Inf in the embedding rows only rank 1 reads, which both ranks refuse naming file and tensor;
    and the experts stored fused (as transformers holds them) under dp=2 x ep=2, each rank
    reading only its own experts' slabs of the fused tensors."""
    from transformers import AutoModelForCausalLM

    fused = tmp_path / "fused"
    AutoModelForCausalLM.from_pretrained(moe_sources[0]).save_pretrained(fused, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in index_hf_tensors(fused)
    poisoned = tmp_path / "poisoned"
    shutil.copytree(moe_sources[0], poisoned)
    file = poisoned / "model.safetensors"
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][150, 3] = float("inf")  # FSDP2: rows 81-160 are rank 1's
    save_file(tensors, file, metadata={"format": "pt"})
    lines = run_forked("sharded_load_worker:main", [*map(str, moe_sources), str(poisoned), str(fused)], 2,
                       tmp_path / "load", env={"OMP_NUM_THREADS": "1"})
    reads = [re.match(r"fused bytes_read (\d+) experts (\d+) stored (\d+)", line) for line in lines
             if line.startswith("fused ")]
    assert len(reads) == 2, lines
    for match in reads:  # half the experts' bytes and about half of the rest (FSDP2), never every expert
        read, experts, stored = int(match[1]), int(match[2]), int(match[3])
        assert experts > stored / 2 and read < stored / 2 + experts / 4, match[0]
    refused = [line for line in lines if line.startswith("refused ")]
    assert len(refused) == 2 and all(f"{file}: tensor 'model.embed_tokens.weight' holds non-finite" in line
                                     for line in refused), lines
    results = [re.match(r"ok (.+) (hf|checkpoint) bytes_read (\d+) largest_read (\d+) stored (\d+)", line)
               for line in lines if line.startswith("ok ")]
    assert len(results) == 2 * 2 * 4, lines
    for match in results:
        layout, kind, read, largest, stored = match[1], match[2], int(match[3]), int(match[4]), int(match[5])
        if kind == "hf" and "dp=2" in layout:  # FSDP2 halves everything: a rank reads about half
            assert read < 0.6 * stored and largest < stored / 4, match[0]
        if kind == "hf" and layout == "tp=2":  # the embedding and experts whole, attention and norms split
            assert read < stored, match[0]
