"""Quantized Hugging Face checkpoints (llmflow.weights.quantized): block-scaled FP8 as DeepSeek-V3
publishes it and MXFP4 as gpt-oss does, dequantized as they are read bit for bit as transformers
dequantizes them, converted into models whose logits are transformers' on the dequantized
weights, FP8 exported back byte for byte, and what llmflow cannot read refused by name."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llmflow.cli import main
from llmflow.models import ConfigError
from llmflow.weights import CheckpointError, latest_step_dir, load_model, read_meta, save_checkpoint
from llmflow.weights.convert import ConvertConfig, convert
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.hf import index_hf_tensors, save_hf_model
from llmflow.weights.quantized import FP8_SCALES, DequantizedTensor, Fp8Blocks
from llmflow.weights.safetensors_io import read_rows, read_tensor
from llmflow.weights.sharded_loading import load_sharded, meta_model, sharded_source

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
BLOCK = 128
# Shapes that are not multiples of the block: every matrix has partial blocks at its edges.
PARTIAL = {"hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 48, "num_hidden_layers": 2}
# Multiples of the block, where transformers' dequantize=True loading reads the blocks right.
WHOLE = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "num_hidden_layers": 2}
VOCAB = 160
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return out


def reference_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scale_inv) of a matrix, block by block, edge blocks partial:
    the math of transformers' Fp8Quantize (forward scale 448 / amax, values clamped to ±448)."""
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            amax = block.abs().amax()
            forward = 448.0 / amax if amax > 0 else torch.tensor(1.0)
            scales[i, j] = 1.0 / forward
            values[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block * forward).clamp(-448, 448).to(
                torch.float8_e4m3fn)
    return values, scales


def transformers_fp8(weight: torch.Tensor, scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own FP8 quantizer (``Fp8Quantize``), blocks of 128 x 128 (whole blocks only)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK), scale_fmt=scale_fmt)
    out = Fp8Quantize(FineGrainedFP8HfQuantizer(config))._quantize_one("w.weight", weight)
    return out["w.weight"], out["w.weight_scale_inv"].float()


def transformers_dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' FP8 dequantization with partial edge blocks (its FP8 matmul's), in float32, as bf16."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(values, scales, [BLOCK, BLOCK], torch.float32).to(torch.bfloat16)


def is_quantized(name: str) -> bool:
    """The weights DeepSeek-V3 stores in FP8: the attention and MLP projections (experts too),
    and its multi-token prediction layer's (here Qwen3-Next's ``mtp.fc``)."""
    return name.endswith(("_proj.weight", "mtp.fc.weight"))


def fp8_checkpoint(hf_dir: Path, out: Path, quantize=reference_fp8, dtype: str = "bfloat16") -> Path:
    """``hf_dir``'s model as DeepSeek-V3 publishes its FP8 checkpoint: bf16 (or ``dtype``), every
    projection float8_e4m3fn with its ``weight_scale_inv`` beside it, quantization_config in config.json."""
    out.mkdir()
    tensors = {}
    for name, tensor in tensors_of(hf_dir).items():
        tensor = tensor.to(getattr(torch, dtype))
        if is_quantized(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config |= {"dtype": dtype, "quantization_config": FP8}
    (out / "config.json").write_text(json.dumps(config))
    return out


def dequantized_reference(fp8_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 checkpoint as transformers dequantizes it, under its dense name."""
    stored = tensors_of(fp8_dir)
    return {name: transformers_dequantized(t, stored[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
            for name, t in stored.items() if not name.endswith("_scale_inv")}


def with_weights(hf_model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``hf_model`` in float32 holding ``tensors`` (the checkpoint's names, per-expert or not)."""
    state = {}
    for name, param in hf_model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # transformers 5 fuses the experts in memory
            prefix = name.removesuffix("gate_up_proj")
            state[name] = torch.stack([torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"],
                                                  tensors[f"{prefix}{e}.up_proj.weight"]]) for e in range(len(param))])
        elif name.endswith("experts.down_proj"):
            state[name] = torch.stack([tensors[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"]
                                       for e in range(len(param))])
        else:
            state[name] = tensors[name]
    hf_model.load_state_dict({k: v.float() for k, v in state.items()})
    return hf_model.float().eval()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of llmflow's model (a tensor) or transformers' (``.logits``) over the real vocabulary."""
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits)[..., :VOCAB].float()


def max_diff(ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor) -> float:
    return (logits(ours, ids) - logits(theirs, ids)).abs().max().item()


# --- FP8 ---------------------------------------------------------------------------------------


def test_reference_quantizer_is_transformers(make_hf_model):
    """The block-by-block quantizer these tests write checkpoints with is transformers' Fp8Quantize
    wherever transformers quantizes (whole blocks), and llmflow's fresh scales are both."""
    g = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(256, 384, generator=g)).to(torch.bfloat16)
    weight[:128, :128] = 0  # a block of zeros: scale 1
    ours, theirs = reference_fp8(weight), transformers_fp8(weight)
    assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8)) and torch.equal(ours[1], theirs[1])
    for scale_fmt in ("float", "ue8m0"):
        scheme = Fp8Blocks((BLOCK, BLOCK), power_of_two=scale_fmt == "ue8m0")
        forward, scales = scheme.fresh_scales(weight)
        values, expected = transformers_fp8(weight, scale_fmt)
        assert torch.equal(scales, expected)
        assert torch.equal(scheme.quantize(weight, forward).view(torch.uint8), values.view(torch.uint8))
    # partial edge blocks: the reference quantizer's blocks
    forward, scales = Fp8Blocks((BLOCK, BLOCK)).fresh_scales(weight[:200, :300])
    values, expected = reference_fp8(weight[:200, :300])
    assert torch.equal(scales, expected)
    assert torch.equal(Fp8Blocks((BLOCK, BLOCK)).quantize(weight[:200, :300], forward).view(torch.uint8),
                       values.view(torch.uint8))


@pytest.mark.parametrize("family, dtype", [("qwen3", "bfloat16"), ("qwen3", "float32"), ("qwen3_moe", "bfloat16")])
def test_fp8_dequantized_as_transformers_loads_it(make_hf_model, tmp_path, tokens, family, dtype):
    """Whole blocks: every tensor llmflow reads is bit-equal to the model transformers loads with
    FineGrainedFP8Config(dequantize=True) (in config.json's dtype), and the logits of the two
    models agree; exported back as FP8, transformers loads the same model again."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    extra = {**MOE, "moe_intermediate_size": 128} if family == "qwen3_moe" else {}
    hf_model, hf_dir = make_hf_model(family, **WHOLE, **extra)
    fp8_dir = fp8_checkpoint(hf_dir, tmp_path / "fp8", quantize=transformers_fp8, dtype=dtype)
    theirs = AutoModelForCausalLM.from_pretrained(fp8_dir, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert theirs.dtype == getattr(torch, dtype)
    index = index_hf_tensors(fp8_dir)
    assert not any(name.endswith("_scale_inv") for name in index)  # the scales are consumed
    ours = {name: read_tensor(stored) for name, stored in index.items()}
    assert all(t.dtype == getattr(torch, dtype) for t in ours.values())
    assert sum(isinstance(stored, DequantizedTensor) for stored in index.values()) == sum(map(is_quantized, ours))
    expected = {name: t.detach() for name, t in with_weights(hf_model, ours).state_dict().items()}
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor.float(), expected[name]), name

    ids = tokens(2, 10)
    model, _ = load_model(fp8_dir)
    diff = max_diff(model, theirs.float().eval(), ids)
    assert diff <= 1e-5, diff
    saved = save_hf_model(model, tmp_path / "saved")  # full precision: no quantization_config
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())

    ckpt = convert(ConvertConfig(hf=fp8_dir, out=tmp_path / "ckpt"))
    back = export(ExportConfig(ckpt=ckpt, out=tmp_path / "back", fp8=True))
    again = AutoModelForCausalLM.from_pretrained(back, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert all(torch.equal(t, theirs.state_dict()[name]) for name, t in again.state_dict().items())


def test_fp8_partial_blocks_and_rows(make_hf_model, tmp_path):
    """Shapes that are not multiples of 128: blocks at the edges partial, as transformers' FP8
    matmul dequantizes them, bit for bit; any rows read alone (a rank's shard) are those rows."""
    _, hf_dir = make_hf_model("qwen3", **PARTIAL)
    fp8_dir = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    index = index_hf_tensors(fp8_dir)
    expected = dequantized_reference(fp8_dir)
    assert sorted(index) == sorted(expected)
    for name, stored in index.items():
        assert torch.equal(read_tensor(stored), expected[name]), name
    q_proj = index["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q_proj, DequantizedTensor) and q_proj.shape == (192, 192) and q_proj.scales.shape == (2, 2)
    up = index["model.layers.0.mlp.up_proj.weight"]
    for start, stop in ((0, 320), (100, 200), (128, 256), (250, 320), (5, 6)):
        assert torch.equal(read_rows(up, start, stop), expected["model.layers.0.mlp.up_proj.weight"][start:stop])
    assert torch.equal(read_tensor(up, rows=330)[320:], torch.zeros(10, 192, dtype=torch.bfloat16))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fp8_convert_logits_and_export(make_hf_model, tmp_path, tokens, family):
    """convert dequantizes (logits = transformers' on the dequantized weights, fp32); export
    writes bf16 without quantization_config, and with --fp8 the input's FP8 bytes exactly."""
    from transformers import AutoModelForCausalLM

    extra = {**MOE, "moe_intermediate_size": 160} if family == "qwen3_moe" else {}
    hf_model, hf_dir = make_hf_model(family, **PARTIAL, **extra)
    fp8_dir = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    ckpt = convert(ConvertConfig(hf=fp8_dir, out=tmp_path / "ckpt"))
    step = latest_step_dir(ckpt)
    assert (step / FP8_SCALES).is_file()
    dequantized = dequantized_reference(fp8_dir)
    reference = with_weights(hf_model, dequantized)
    ids = tokens(2, 12)
    model, _ = load_model(ckpt)
    diff = max_diff(model, reference, ids)
    assert diff <= 1e-5, diff

    full = export(ExportConfig(ckpt=ckpt, out=tmp_path / "bf16"))
    config = json.loads((full / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    written = tensors_of(full)
    assert written.keys() == dequantized.keys()
    assert all(torch.equal(written[name], t) for name, t in dequantized.items())
    transformers_model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32, attn_implementation="eager")
    assert torch.equal(logits(transformers_model, ids), logits(reference, ids))

    back = tmp_path / "fp8_again"
    main(["export", "--ckpt", str(ckpt), "--out", str(back), "--fp8"])
    assert json.loads((back / "config.json").read_text())["quantization_config"] == FP8
    original, again = tensors_of(fp8_dir), tensors_of(back)
    assert again.keys() == original.keys()
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype, name
        assert torch.equal(again[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert json.loads((back / "manifest.json").read_text())["fp8"]["fresh_scales"] == []
    # cast to float32, the FP8 weights are still those of the input, the other tensors float32; one
    # tensor a shard, a weight's scales opening the next
    wide_dir = export(ExportConfig(ckpt=ckpt, out=tmp_path / "fp32", fp8=True, dtype="float32", max_shard_mb=1e-6))
    assert len(list(wide_dir.glob("*.safetensors"))) == len(original)
    wide = tensors_of(wide_dir)
    for name, tensor in original.items():
        if tensor.dtype == torch.bfloat16:
            assert wide[name].dtype == torch.float32 and torch.equal(wide[name], tensor.float()), name
        else:
            assert torch.equal(wide[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_fp8_sharded_load_is_the_whole_load(make_hf_model, tmp_path):
    """A training rank reading its shards of an FP8 checkpoint gets what load_model gets."""
    _, hf_dir = make_hf_model("qwen3_moe", **PARTIAL, **MOE, moe_intermediate_size=160)
    fp8_dir = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    whole, _ = load_model(fp8_dir)
    source = sharded_source(fp8_dir)
    sharded = meta_model(source)
    load_sharded(sharded, [sharded], source, torch.device("cpu"))
    want = dict(whole.named_parameters())
    assert [name for name, param in sharded.named_parameters() if not torch.equal(param, want[name])] == []


@pytest.mark.parametrize("base", ["checkpoint", "hf"])
def test_fp8_export_of_merged_lora(make_hf_model, tmp_path, base):
    """A LoRA-merged weight is written with fresh scales (transformers' Fp8Quantize math, edge
    blocks partial); every untouched weight with the recorded ones, bit for bit."""
    _, hf_dir = make_hf_model("qwen3", **PARTIAL)
    fp8_dir = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    ckpt = convert(ConvertConfig(hf=fp8_dir, out=tmp_path / "ckpt", pad_vocab_to_multiple=1))
    meta = read_meta(latest_step_dir(ckpt))
    module = "model.layers.1.self_attn.v_proj"
    g = torch.Generator().manual_seed(1)
    adapters = {f"{module}.lora_A.weight": 0.1 * torch.randn(4, 192, generator=g),
                f"{module}.lora_B.weight": 0.1 * torch.randn(96, 4, generator=g)}
    meta = meta.model_copy(update={"lora": {"rank": 4, "alpha": 8}, "base_checkpoint": str(
        ckpt if base == "checkpoint" else fp8_dir)})
    save_checkpoint(tmp_path / "lora", 3, {"model": adapters}, meta)
    with pytest.raises(CheckpointError, match="--fp8 writes whole weights, so export it with --merge-lora"):
        export(ExportConfig(ckpt=tmp_path / "lora", out=tmp_path / "peft", fp8=True))
    with pytest.raises(ValueError, match="--fp8 writes a Hugging Face directory"):
        ExportConfig(ckpt=tmp_path / "lora", megatron=tmp_path / "megatron", merge_lora=True, fp8=True)
    out = export(ExportConfig(ckpt=tmp_path / "lora", out=tmp_path / "merged", merge_lora=True, fp8=True))
    assert json.loads((out / "manifest.json").read_text())["fp8"]["fresh_scales"] == [f"{module}.weight"]
    original, written = tensors_of(fp8_dir), tensors_of(out)
    dequantized = dequantized_reference(fp8_dir)
    merged = (dequantized[f"{module}.weight"].float() + 2.0 * adapters[f"{module}.lora_B.weight"]
              @ adapters[f"{module}.lora_A.weight"]).to(torch.bfloat16)
    values, scales = reference_fp8(merged)
    assert torch.equal(written[f"{module}.weight"].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(written[f"{module}.weight_scale_inv"], scales)
    for name, tensor in original.items():
        if not name.startswith(module):
            assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_fp8_round_trip_is_exact():
    """Quantizing value * scale (rounded to bf16 or fp32) with the same scale gives back every
    finite e4m3 value, for scales from 2^-100 to 2^20; float16 is not covered (its subnormals)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn)
    finite = values.float().isfinite()
    values, codes = values[finite], codes[finite]
    g = torch.Generator().manual_seed(0)
    exponents = torch.arange(-100, 21, dtype=torch.float32)
    scales = (torch.exp2(exponents)[:, None] * (1 + torch.rand(len(exponents), 64, generator=g))).reshape(-1, 1)
    scheme = Fp8Blocks((1, len(values)))
    grid = values[None].expand(len(scales), -1).contiguous()
    for dtype in (torch.bfloat16, torch.float32):
        dense = scheme.dequantize(grid, scales, dtype)
        again = scheme.quantize(dense, 1.0 / scales)
        assert torch.equal(again.view(torch.uint8), codes[None].expand_as(again)), dtype
    small = scheme.dequantize(grid[:1], torch.tensor([[2.0 ** -20]]), torch.float16)
    assert not torch.equal(scheme.quantize(small, torch.tensor([[2.0 ** 20]])).view(torch.uint8), codes[None])


def test_fp8_carried_tensors_come_back_fp8(make_hf_model, tmp_path):
    """Tensors the decoder does not hold (Qwen3-Next's MTP layer) stored FP8 are carried
    dequantized, exported bf16, and with --fp8 written back in FP8, bit for bit."""
    _, hf_dir = make_hf_model("qwen3_next", **LINEAR, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                              num_experts=0, layer_types=["linear_attention", "full_attention"])
    with_mtp = tmp_path / "with_mtp"
    with_mtp.mkdir()
    g = torch.Generator().manual_seed(5)
    mtp = {"mtp.fc.weight": torch.randn(64, 128, generator=g), "mtp.norm.weight": torch.randn(64, generator=g)}
    save_file(tensors_of(hf_dir) | mtp, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_dir / "config.json", with_mtp / "config.json")
    fp8_dir = fp8_checkpoint(with_mtp, tmp_path / "fp8")
    ckpt = convert(ConvertConfig(hf=fp8_dir, out=tmp_path / "ckpt"))
    dequantized = dequantized_reference(fp8_dir)
    assert torch.equal(tensors_of(ckpt / "carried")["mtp.fc.weight"], dequantized["mtp.fc.weight"])
    assert torch.equal(tensors_of(export(ExportConfig(ckpt=ckpt, out=tmp_path / "bf16")))["mtp.fc.weight"],
                       dequantized["mtp.fc.weight"])
    original, again = tensors_of(fp8_dir), tensors_of(export(ExportConfig(ckpt=ckpt, out=tmp_path / "back", fp8=True)))
    assert again.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(again[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_fused_fp8_experts_convert_but_do_not_export_as_fp8(make_hf_model, tmp_path, tokens):
    """Experts fused as transformers 5 holds them (gate_up_proj, down_proj) and stored FP8 are read
    expert by expert; export writes one tensor per expert, so --fp8 says it cannot keep their blocks."""
    hf_model, hf_dir = make_hf_model("qwen3_moe", **PARTIAL, **MOE, moe_intermediate_size=160)
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    fused, dense = {}, {}
    for name, param in hf_model.state_dict().items():
        tensor = param.to(torch.bfloat16)
        if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name:
            pairs = [reference_fp8(expert) for expert in tensor]
            fused[name] = torch.stack([v for v, _ in pairs])
            fused[name + "_scale_inv"] = torch.stack([s for _, s in pairs])
            dense[name] = torch.stack([transformers_dequantized(v, s) for v, s in pairs])
        else:
            fused[name] = dense[name] = tensor
    save_file(fused, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text()) | {"quantization_config": FP8, "dtype": "bfloat16"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    hf_model.load_state_dict({k: v.float() for k, v in dense.items()})
    gate_up = index_hf_tensors(fp8_dir)["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(read_tensor(gate_up), dense["model.layers.0.mlp.experts.gate_up_proj"])
    assert torch.equal(read_rows(gate_up, 1, 3), dense["model.layers.0.mlp.experts.gate_up_proj"][1:3])
    ids = tokens(2, 12)
    model, _ = load_model(fp8_dir)
    diff = max_diff(model, hf_model.float().eval(), ids)
    assert diff <= 1e-5, diff
    ckpt = convert(ConvertConfig(hf=fp8_dir, out=tmp_path / "ckpt"))
    assert not (latest_step_dir(ckpt) / FP8_SCALES).exists()
    with pytest.raises(CheckpointError, match="no FP8 scales recorded"):
        export(ExportConfig(ckpt=ckpt, out=tmp_path / "out", fp8=True))


# --- MXFP4 -------------------------------------------------------------------------------------


def mxfp4_quantize(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``dense`` [E, in, out] by the OCP MX spec (e8m0 shared exponent
    floor(log2 amax) - 2, e2m1 elements rounded to nearest, 32 a block along ``in``), laid out
    as gpt-oss stores them: [E, out, in / 32, 16] (low nibble first) and [E, out, in / 32]."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    rows = dense.transpose(1, 2).float()
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -126))) - 2
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - torch.tensor(FP4_VALUES[:8])).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def test_mxfp4_dequantized_as_transformers_loads_gpt_oss(tmp_path):
    """gpt-oss's MXFP4 experts: llmflow reads mlp.experts.gate_up_proj / down_proj bit-equal to the
    model transformers loads with Mxfp4Config(dequantize=True), and to convert_moe_packed_tensors."""
    from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = GptOssConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=128,
                          layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(tensor)
        else:
            tensors[name] = tensor
    directory = tmp_path / "gpt_oss"
    model.config.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(hf))
    theirs = GptOssForCausalLM.from_pretrained(directory, quantization_config=Mxfp4Config(dequantize=True)).state_dict()
    index = index_hf_tensors(directory)
    assert set(index) == set(theirs)  # the dense names; blocks and scales consumed
    for name, stored in index.items():
        assert torch.equal(read_tensor(stored), theirs[name]), name
        if name.endswith(("gate_up_proj", "down_proj")):
            packed = convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"])
            assert torch.equal(read_tensor(stored), packed)
            assert torch.equal(read_rows(stored, 1, 3), packed[1:3])


def test_mxfp4_fused_experts_convert(make_hf_model, tmp_path, tokens):
    """MXFP4 experts of an existing family (Qwen3-MoE, fused as transformers 5 reads them): the
    converted model's logits are those of transformers' model on the dequantized experts."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model, hf_dir = make_hf_model("qwen3_moe", **MOE, moe_intermediate_size=32)
    directory = tmp_path / "mxfp4"
    directory.mkdir()
    tensors, dense = {}, {}
    for name, param in hf_model.state_dict().items():
        tensor = param.to(torch.bfloat16)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(tensor)  # blocks of 32 along dim 1
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dense[name] = convert_moe_packed_tensors(blocks, scales)
        else:
            tensors[name] = dense[name] = tensor
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text()) | {"quantization_config": {"quant_method": "mxfp4"}}
    (directory / "config.json").write_text(json.dumps(config))
    hf_model.load_state_dict({k: v.float() for k, v in dense.items()})
    ckpt = convert(ConvertConfig(hf=directory, out=tmp_path / "ckpt"))
    ids = tokens(2, 12)
    model, _ = load_model(ckpt)
    diff = max_diff(model, hf_model.float().eval(), ids)
    assert diff <= 1e-5, diff
    with pytest.raises(CheckpointError, match="quant_method"):
        export(ExportConfig(ckpt=ckpt, out=tmp_path / "out", fp8=True))
    full = export(ExportConfig(ckpt=ckpt, out=tmp_path / "bf16"))
    assert "quantization_config" not in json.loads((full / "config.json").read_text())


# --- refused -----------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization, named", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({**FP8, "fmt": "e5m2"}, "quantization_config.fmt='e5m2'"),
    ({**FP8, "weight_block_size": [128]}, "weight_block_size=[128]"),
    ({**FP8, "weight_block_size": None}, "weight_block_size=None"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme='static'"),
])
def test_unsupported_quantization_is_refused_before_any_work(make_hf_model, tmp_path, quantization, named):
    _, hf_dir = make_hf_model("qwen3", **PARTIAL)
    directory = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    config = json.loads((directory / "config.json").read_text()) | {"quantization_config": quantization}
    (directory / "config.json").write_text(json.dumps(config))
    for run in (lambda: convert(ConvertConfig(hf=directory, out=tmp_path / "ckpt")), lambda: load_model(directory)):
        with pytest.raises(ConfigError, match=re.escape(f"{directory / 'config.json'}: ") + ".*" + re.escape(named)):
            run()
    assert not (tmp_path / "ckpt").exists()


def test_missing_scales_are_refused_naming_both_tensors(make_hf_model, tmp_path):
    _, hf_dir = make_hf_model("qwen3", **PARTIAL)
    directory = fp8_checkpoint(hf_dir, tmp_path / "fp8")
    tensors = tensors_of(directory)
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"FP8 tensor 'model.layers.1.mlp.down_proj.weight' has no scale "
                                              r"tensor 'model.layers.1.mlp.down_proj.weight_scale_inv'"):
        convert(ConvertConfig(hf=directory, out=tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()

    mxfp4 = tmp_path / "mxfp4"
    mxfp4.mkdir()
    blocks, _ = mxfp4_quantize(torch.randn(2, 64, 32))
    save_file({"model.layers.0.mlp.experts.down_proj_blocks": blocks}, str(mxfp4 / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text()) | {"quantization_config": {"quant_method": "mxfp4"}}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.down_proj_blocks' have no scale tensor "
                                              r"'model.layers.0.mlp.experts.down_proj_scales'"):
        index_hf_tensors(mxfp4)
