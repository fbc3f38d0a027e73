"""Training checkpoints (llmflow.weights.training_checkpoint), ``llmflow convert`` and ``llmflow export``:
HF -> checkpoint -> HF is bit-exact, vocabulary padding, crash safety of save_checkpoint,
LoRA export (merged and PEFT layout) and clear errors on bad input."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from llmflow.artifacts import read_manifest
from llmflow.cli import main
from llmflow.models import CausalLM, ConfigError, ModelConfig
from llmflow.weights import (
    CheckpointError,
    CheckpointMeta,
    latest_step_dir,
    load_checkpoint,
    load_rng_state,
    read_meta,
    save_checkpoint,
)
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.hf import safetensors_files
from llmflow.weights.training_checkpoint import padded_vocab_size, step_name

VOCAB = 160
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def add_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of VOCAB ids with a chat template, saved by transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(directory)


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {name: t for path in safetensors_files(directory) for name, t in file_tensors(path).items()}


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def padded_model(step_dir: Path) -> CausalLM:
    """A CausalLM shaped like the checkpoint (padded vocabulary), weights loaded from it."""
    meta = read_meta(step_dir)
    config = dataclasses.replace(ModelConfig.from_hf(meta.hf_config), vocab_size=meta.padded_vocab_size)
    model = CausalLM(config)
    load_checkpoint(step_dir, {"model": model.state_dict()})
    return model


@pytest.fixture
def llama(make_hf_model):
    """An untied tiny Llama with a tokenizer, converted with default padding."""
    hf_model, hf_dir = make_hf_model("llama", tie_word_embeddings=False)
    add_tokenizer(hf_dir)
    ckpt = convert(ConvertConfig(hf=hf_dir, out=hf_dir.parent / "ckpt"))
    return hf_model, hf_dir, ckpt


EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize(
    "family, tied, save_kwargs, shard_mb, via_cli, extra",
    [
        ("llama", False, None, 4096, True, {}),
        ("qwen2", True, {"max_shard_size": "40KB"}, 0.05, False, {}),
        ("mistral", False, None, 4096, False, {}),
        ("qwen3", False, None, 4096, False, {}),  # transformers' default head_dim, 128, not hidden / heads
        # The Hub's per-expert tensors, stacked in the checkpoint and split again, across shards.
        ("qwen3_moe", False, {"max_shard_size": "40KB"}, 0.05, False, {**EXPERTS, "head_dim": 16}),
        ("qwen2_moe", True, None, 4096, False, {**EXPERTS, "shared_expert_intermediate_size": 48}),
        ("mixtral", False, None, 4096, False, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_hf_to_checkpoint_to_hf_is_bit_exact(
    make_hf_model, tokens, tmp_path, monkeypatch, family, tied, save_kwargs, shard_mb, via_cli, extra
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if shard_mb < 1:  # also read the checkpoint a few tensors at a time
        monkeypatch.setattr("llmflow.weights.export.READ_BATCH_BYTES", 30_000)

    hf_model, hf_dir = make_hf_model(family, tie_word_embeddings=tied, save_kwargs=save_kwargs, **extra)
    add_tokenizer(hf_dir)
    ckpt, out = tmp_path / "ckpt", tmp_path / "export"
    if via_cli:
        main(["convert", "--hf", str(hf_dir), "--out", str(ckpt), "--pad-vocab-to-multiple", "256"])
        main(["export", "--ckpt", str(ckpt), "--out", str(out)])
    else:
        convert(ConvertConfig(hf=hf_dir, out=ckpt, pad_vocab_to_multiple=256))
        export(ExportConfig(ckpt=ckpt, out=out, max_shard_mb=shard_mb))

    assert read_meta(latest_step_dir(ckpt)).padded_vocab_size == 256
    assert read_manifest(ckpt)["stage"] == "convert" and read_manifest(out)["stage"] == "export"
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert (out / "model.safetensors.index.json").is_file() == (shard_mb < 1)
    assert (out / "chat_template.jinja").is_file() and (out / "generation_config.json").is_file()

    ids = tokens(2, 12)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert torch.equal(logits(reloaded, ids), logits(hf_model, ids))
    text = "w5 w17 w150 unknown"
    exported_ids = AutoTokenizer.from_pretrained(out)(text)["input_ids"]
    assert exported_ids == AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_rows_are_zero_padded_in_the_checkpoint(make_hf_model, tmp_path, tied):
    hf_model, hf_dir = make_hf_model("qwen2", tie_word_embeddings=tied)
    convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt", pad_vocab_to_multiple=24))
    step_dir = latest_step_dir(tmp_path / "ckpt")
    meta = read_meta(step_dir)
    assert step_dir.name == step_name(0) and meta.padded_vocab_size == 168 and meta.hf_config["vocab_size"] == VOCAB
    assert meta.contents == ["model"] and meta.layout == {"pp": 1, "dp": 1, "tp": 1}
    assert read_manifest(tmp_path / "ckpt")["padded_vocab_size"] == 168

    model = padded_model(step_dir)
    for ours, theirs in ((model.model.embed_tokens, hf_model.model.embed_tokens), (model.lm_head, hf_model.lm_head)):
        assert ours.weight.shape == (168, 64)
        assert torch.equal(ours.weight[:VOCAB], theirs.weight)
        assert not ours.weight[VOCAB:].any()

    convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt", pad_vocab_to_multiple=1))
    assert read_meta(latest_step_dir(tmp_path / "ckpt")).padded_vocab_size == VOCAB


@pytest.mark.parametrize("tied", [False, True])
def test_a_padded_checkpoint_computes_the_unpadded_models_logits_and_loss(make_hf_model, tokens, tmp_path, tied):
    """Padding must not change what the model computes: the padded rows stay out of the logits
    and the loss (and get no gradient)."""
    import torch.nn.functional as F

    from llmflow.weights import load_model

    hf_model, hf_dir = make_hf_model("qwen2", tie_word_embeddings=tied)
    convert(ConvertConfig(hf=hf_dir, out=tmp_path / "ckpt", pad_vocab_to_multiple=24))
    model, _ = load_model(tmp_path / "ckpt")
    assert model.lm_head.weight.shape[0] == 168 and model.config.unpadded_vocab_size == VOCAB
    ids = tokens(2, 12, VOCAB)
    labels = ids.roll(-1, dims=1)
    with torch.no_grad():
        expected = hf_model(ids).logits
        assert_close(model(ids), expected, atol=1e-5, rtol=0)  # fp32 logits within 1e-5
        expected_loss = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = model(ids, labels=labels, loss_reduction="sum")
    assert_close(loss.detach(), expected_loss, atol=1e-5 * labels.numel(), rtol=0)
    loss.backward()
    assert not model.lm_head.weight.grad[VOCAB:].any() and model.lm_head.weight.grad[:VOCAB].any()


@pytest.mark.parametrize("tied", [False, True])
def test_random_init_needs_only_the_config_and_is_seeded(make_hf_model, tmp_path, tied):
    _hf_model, hf_dir = make_hf_model("qwen2", tie_word_embeddings=tied)
    for weights in safetensors_files(hf_dir):
        weights.unlink()  # from scratch: config.json and the tokenizer are all it reads
    for out, seed in (("a", 0), ("b", 0), ("c", 1)):
        convert(ConvertConfig(hf=hf_dir, out=tmp_path / out, init="random", seed=seed, pad_vocab_to_multiple=24))
    a, b, c = (padded_model(latest_step_dir(tmp_path / name)) for name in "abc")
    assert read_manifest(tmp_path / "a")["params"]["init"] == "random"
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc) or name.endswith(("norm.weight", ".bias")), name
    for weight in (a.model.embed_tokens.weight, a.lm_head.weight):
        assert weight.shape[0] == 168 and not weight[VOCAB:].any()  # padding rows zero, as when converting
        assert weight[:VOCAB].std().item() == pytest.approx(0.02, rel=0.1)


def test_padded_vocab_size_rule():
    assert padded_vocab_size(32000, 128) == 32000
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(151665, 1) == 151665
    with pytest.raises(ValueError, match="multiple=0"):
        padded_vocab_size(100, 0)


def test_convert_has_no_tensor_parallel_setting():
    """A checkpoint does not depend on the tensor-parallel degree it will train with."""
    with pytest.raises(ValueError, match="tp"):
        ConvertConfig(hf="model", out="ckpt", tp=2)


def tiny_state(seed: int) -> tuple[CausalLM, CheckpointMeta]:
    config = ModelConfig.from_hf(
        {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
         "num_hidden_layers": 1, "num_attention_heads": 2}
    )
    model = CausalLM(config)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model, CheckpointMeta(hf_config=config.hf_config, padded_vocab_size=32)


@pytest.mark.parametrize(
    "crash_in, after", [("dcp_save", False), ("dcp_save", True), ("replace_directory", True), ("_write_latest", False)]
)
def test_killed_save_leaves_previous_latest_intact(tmp_path, monkeypatch, crash_in, after):
    from llmflow.weights import training_checkpoint

    root = tmp_path / "run"
    first, meta = tiny_state(0)
    save_checkpoint(root, 1, {"model": first.state_dict(), "train": {"step": 1, "consumed_samples": 8}}, meta)
    second, _ = tiny_state(1)

    original = getattr(training_checkpoint, crash_in)

    def crash(*args, **kwargs):
        if after:
            original(*args, **kwargs)
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        m.setattr(training_checkpoint, crash_in, crash)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(root, 2, {"model": second.state_dict()}, meta)

    step_dir = latest_step_dir(root)
    assert step_dir == root / step_name(1)
    loaded, _ = tiny_state(2)
    state = {"model": loaded.state_dict(), "train": {"step": 0, "consumed_samples": 0}}
    assert load_checkpoint(step_dir, state).step == 1
    assert state["train"] == {"step": 1, "consumed_samples": 8}
    for name, tensor in first.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    assert save_checkpoint(root, 2, {"model": second.state_dict()}, meta) == root / step_name(2)
    assert latest_step_dir(root) == root / step_name(2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(1), step_name(2)]


def test_keep_prunes_old_steps_and_rng_state_round_trips(tmp_path):
    root = tmp_path / "run"
    model, meta = tiny_state(0)
    rng = {"torch": torch.get_rng_state()}
    for step in (10, 20, 30, 40):
        save_checkpoint(root, step, {"model": model.state_dict()}, meta, keep=2, rng_state=rng)
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(30), step_name(40)]
    step_dir = latest_step_dir(root)
    meta = read_meta(step_dir)
    assert (meta.step, meta.contents) == (40, ["model"])
    assert torch.equal(load_rng_state(step_dir, 0)["torch"], rng["torch"])
    assert load_rng_state(step_dir, 1) is None
    with pytest.raises(CheckpointError, match="optimizer"):
        load_checkpoint(step_dir, {"model": model.state_dict(), "optimizer": {}})
    with pytest.raises(ValueError, match="keep=0"):
        save_checkpoint(root, 50, {"model": model.state_dict()}, meta, keep=0)


def test_export_of_training_checkpoint_reads_model_keys_only(llama, tmp_path):
    _, hf_dir, ckpt = llama
    model = padded_model(latest_step_dir(ckpt))
    root = tmp_path / "run"
    state = {"model": model.state_dict(), "optimizer": {"exp_avg": torch.randn(7)}, "train": {"step": 7}}
    meta = read_meta(latest_step_dir(ckpt))
    save_checkpoint(root, 7, state, meta.model_copy(update={"layout": {"dp": 2, "tp": 1}}))
    save_checkpoint(root, 9, {"model": CausalLM(model.config).state_dict()}, meta)

    out = export(ExportConfig(ckpt=root, step=7, out=tmp_path / "hf", dtype="bfloat16"))
    exported, original = hf_tensors(out), hf_tensors(hf_dir)
    assert all(torch.equal(exported[n], t.to(torch.bfloat16)) for n, t in original.items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # No tokenizer beside the training run: the export says so but still succeeds.
    assert not (out / "tokenizer.json").exists()
    assert read_manifest(out)["step"] == 7


def fake_adapters(model: CausalLM, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    adapters = {}
    for i in model.model.layers:
        for proj in ("q_proj", "v_proj"):
            weight = model.get_parameter(f"model.layers.{i}.self_attn.{proj}.weight")
            module = f"model.layers.{i}.self_attn.{proj}"
            adapters[f"{module}.lora_A.weight"] = 0.1 * torch.randn(rank, weight.shape[1], generator=g)
            adapters[f"{module}.lora_B.weight"] = 0.1 * torch.randn(weight.shape[0], rank, generator=g)
    return adapters


@pytest.mark.parametrize("base", ["checkpoint", "hf"])
def test_lora_export_merged_and_peft(llama, tokens, tmp_path, monkeypatch, base):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("llmflow.weights.export.READ_BATCH_BYTES", 30_000)

    hf_model, hf_dir, ckpt = llama
    base_meta = read_meta(latest_step_dir(ckpt))
    adapters = fake_adapters(padded_model(latest_step_dir(ckpt)), rank=4)
    lora = {"lora": {"rank": 4, "alpha": 8, "dropout": 0.05}}
    if base == "checkpoint":
        meta = base_meta.model_copy(update={**lora, "base_checkpoint": str(ckpt)})
    else:  # trained straight from the Hugging Face directory: no vocabulary padding
        meta = base_meta.model_copy(update={**lora, "base_checkpoint": str(hf_dir), "padded_vocab_size": VOCAB})
    save_checkpoint(tmp_path / "lora", 5, {"model": adapters}, meta)

    merged = export(ExportConfig(ckpt=tmp_path / "lora", out=tmp_path / "merged", merge_lora=True))
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            module = name.removesuffix(".weight")
            if f"{module}.lora_A.weight" in adapters:
                param += 2.0 * (adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"])
    ids = tokens(2, 12)
    reloaded = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    assert torch.equal(logits(reloaded, ids), logits(hf_model, ids))
    assert (merged / "tokenizer.json").is_file()  # from the base's tokenizer
    assert read_manifest(merged)["kind"] == "merged"
    # the same merge into a Megatron checkpoint, read back
    export(ExportConfig(ckpt=tmp_path / "lora", megatron=tmp_path / "megatron", merge_lora=True, tp=2))
    convert(ConvertConfig(hf=hf_dir, megatron=tmp_path / "megatron", out=tmp_path / "from-megatron"))
    back = export(ExportConfig(ckpt=tmp_path / "from-megatron", out=tmp_path / "merged-again"))
    assert all(torch.equal(hf_tensors(back)[n], t) for n, t in hf_tensors(merged).items())

    peft = export(ExportConfig(ckpt=tmp_path / "lora", out=tmp_path / "peft", base_model="org/tiny-llama"))
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["lora_dropout"] == 0.05
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] == "org/tiny-llama" and config["task_type"] == "CAUSAL_LM"
    weights = file_tensors(peft / "adapter_model.safetensors")
    assert sorted(weights) == sorted(f"base_model.model.{n}" for n in adapters)
    assert all(torch.equal(weights[f"base_model.model.{n}"], t) for n, t in adapters.items())
    assert not (peft / "config.json").exists() and not list(peft.glob("model*.safetensors"))


def test_bad_input_is_named_before_any_work(make_hf_model, tmp_path, capsys):
    _, hf_dir = make_hf_model("llama")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=str(no_config)):
        convert(ConvertConfig(hf=no_config, out=tmp_path / "a"))

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=str(no_weights)):
        convert(ConvertConfig(hf=no_weights, out=tmp_path / "a"))

    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB + 1}))
    with pytest.raises(CheckpointError, match="embed_tokens"):
        convert(ConvertConfig(hf=hf_dir, out=tmp_path / "a"))
    assert not (tmp_path / "a").exists()

    with pytest.raises(SystemExit, match=f"llmflow convert: --hf {tmp_path / 'missing'}: not a directory"):
        main(["convert", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match=f"llmflow export: {no_weights} has no 'latest' file"):
        main(["export", "--ckpt", str(no_weights), "--out", str(tmp_path / "b")])


def test_outputs_never_replace_foreign_directories(llama, tmp_path):
    _, hf_dir, ckpt = llama
    with pytest.raises(CheckpointError, match="not the output of an earlier 'llmflow convert'"):
        convert(ConvertConfig(hf=hf_dir, out=hf_dir))
    with pytest.raises(CheckpointError, match="not the output of an earlier 'llmflow export'"):
        export(ExportConfig(ckpt=ckpt, out=ckpt))
    with pytest.raises(CheckpointError, match="step_00000003"):
        export(ExportConfig(ckpt=ckpt, out=tmp_path / "x", step=3))
    (ckpt / "latest").write_text("step_00000042\n")
    with pytest.raises(CheckpointError, match="names 'step_00000042'"):
        export(ExportConfig(ckpt=ckpt, out=tmp_path / "x"))


def test_bad_lora_checkpoints_fail_before_writing(llama, tmp_path):
    _, _, ckpt = llama
    base_meta = read_meta(latest_step_dir(ckpt))
    adapters = fake_adapters(padded_model(latest_step_dir(ckpt)), rank=4)
    lora = {"rank": 4, "alpha": 8}

    save_checkpoint(tmp_path / "no_base", 1, {"model": adapters}, base_meta.model_copy(update={"lora": lora}))
    with pytest.raises(CheckpointError, match="names no base_checkpoint"):
        export(ExportConfig(ckpt=tmp_path / "no_base", out=tmp_path / "out", merge_lora=True))

    wrong = {**adapters, "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 3)}
    relative = os.path.relpath(ckpt, tmp_path / "wrong")  # taken from the LoRA checkpoint's root
    meta = base_meta.model_copy(update={"lora": lora, "base_checkpoint": relative})
    save_checkpoint(tmp_path / "wrong", 1, {"model": wrong}, meta)
    with pytest.raises(CheckpointError, match=r"adapter of model.layers.0.self_attn.q_proj \(A \(4, 3\)"):
        export(ExportConfig(ckpt=tmp_path / "wrong", out=tmp_path / "out", merge_lora=True))

    save_checkpoint(tmp_path / "no_rank", 1, {"model": adapters}, base_meta.model_copy(update={"lora": {"alpha": 8}}))
    with pytest.raises(CheckpointError, match="needs 'rank' and 'alpha'"):
        export(ExportConfig(ckpt=tmp_path / "no_rank", out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
