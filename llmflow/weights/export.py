"""The export stage: a training checkpoint (``training_checkpoint.py``) -> a Hugging Face model
directory (or, with ``megatron``, a Megatron-LM / MindSpeed-LLM checkpoint: ``megatron/exporter.py``).

Any step directory exports, whatever layout it was saved under: DCP reshards while one
process reads the model tensors (and only those: optimizer state is never read). The
output is safetensors (sharded with an index past ``max_shard_mb``), the original
config.json (vocabulary padding removed) and the tokenizer files, which transformers
loads, with the tensors the decoder does not hold (a vision tower, multi-token prediction
layers) carried from the original checkpoint bit for bit (``carried.py``). Each safetensors
file is written header first and then tensor by tensor, so memory
stays near READ_BATCH_BYTES (or the largest tensor), whatever the model's size.

The weights are written in full precision, as the checkpoint holds them (a checkpoint converted
from a quantized one: dequantized, and config.json without its quantization_config). With
``fp8`` the weights that were FP8 in the checkpoint converted are written back as FP8 in its
blocks, bit for bit where untouched (``quantized.Fp8Writer``), under its quantization_config.

A LoRA checkpoint (meta.lora set) holds only adapters. With ``merge_lora`` the base
weights (meta.base_checkpoint: a checkpoint, or the Hugging Face directory training
started from) are written with ``W + alpha / rank * B @ A`` merged into every adapted
weight; without it the adapters are written in PEFT's layout (adapter_config.json +
adapter_model.safetensors).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.models.config import ModelConfig
from llmflow.weights.carried import Carried, untrained_tensors
from llmflow.weights.errors import CheckpointError
from llmflow.weights.hf import write_hf_weights
from llmflow.weights.hf_names import TIED_INPUT, TIED_OUTPUT, hf_names, is_stacked_experts, split_experts
from llmflow.weights.lora_adapters import (
    LORA_A,
    LORA_B,
    check_adapter_shapes,
    expert_targets,
    is_expert_adapter,
    lora_modules,
    lora_scale,
    merged_loader,
    peft_expert_tensor,
)
from llmflow.weights.megatron.exporter import Layout, check_layout, write_megatron
from llmflow.weights.quantized import (
    FP8_SCALES,
    QUANTIZATION_CONFIG,
    Fp8Blocks,
    Fp8Writer,
    dequantized_dtype,
    fp8_scales,
    read_fp8_scales,
    read_quantization,
)
from llmflow.weights.safetensors_io import plan_shards, write_safetensors
from llmflow.weights.stage_output import check_replaceable
from llmflow.weights.tensor_source import Source, TensorInfo, base_source, weight_names
from llmflow.weights.tokenizer_files import copy_tokenizer_files
from llmflow.weights.training_checkpoint import META, CheckpointMeta, resolve_step_dir

STAGE = "export"
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Most bytes read from the checkpoint at once (a bigger tensor is read alone).
READ_BATCH_BYTES = 64 * 2**20
# Tensors whose dim 0 runs over the (padded) vocabulary.
_VOCAB_ROWS = (TIED_INPUT, TIED_OUTPUT, "lm_head" + LORA_B)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger(__name__)


class ExportConfig(BaseModel):
    """Export a training checkpoint as a Hugging Face model directory (or a PEFT adapter)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    ckpt: Path
    """Checkpoint root (its latest step is exported) or one step directory."""
    out: Path | None = None
    """Hugging Face directory to write: safetensors, config.json, tokenizer files, manifest.json."""
    megatron: Path | None = None
    """Write a Megatron-LM / MindSpeed-LLM checkpoint root here instead of --out: iter_NNNNNNN/
    (megatron-core's torch_dist format, or the legacy per-rank layout) and
    latest_checkpointed_iteration.txt, for a GPTModel of the same config."""
    tp: int = Field(default=1, ge=1)
    """Megatron: tensor-parallel size the checkpoint is for (its vocabulary is padded to a
    multiple of vocab_multiple * tp; the legacy layout is split into tp ranks)."""
    pp: int = Field(default=1, ge=1)
    """Megatron: pipeline-parallel size (an even split of the layers; the legacy layout has a
    rank directory per stage)."""
    ep: int = Field(default=1, ge=1)
    """Megatron, mixture-of-experts models: expert-parallel size (it must divide the experts;
    the legacy layout has a rank directory per expert-parallel rank, holding its experts)."""
    megatron_format: Literal["torch_dist", "legacy"] = "torch_dist"
    """Megatron: torch_dist (megatron-core's distributed checkpoint, resharded on load) or legacy
    (mp_rank_*/model_optim_rng.pt, Megatron-LM's --ckpt-format torch)."""
    megatron_spec: Literal["transformer_engine", "local"] | None = None
    """Megatron: the layer spec the names follow, megatron-core's Transformer Engine spec
    (Megatron-LM's default --transformer-impl) or its local spec (default: transformer_engine
    for torch_dist and for grouped experts, local for legacy). They name a MoE layer's
    post-attention norm differently in torch_dist, and every norm in legacy files."""
    moe_grouped_gemm: bool = False
    """Megatron, mixture-of-experts models: the experts as megatron-core's TEGroupedMLP
    (--moe-grouped-gemm) instead of its default SequentialMLP: legacy files name them
    mlp.experts.linear_fc1.weight{j}; torch_dist stores both alike."""
    vocab_multiple: int = Field(default=128, ge=1)
    """Megatron: make-vocab-size-divisible-by (the padded vocabulary is a multiple of it times tp)."""
    iteration: int | None = Field(default=None, ge=0)
    """Megatron: the iteration the checkpoint is saved as (default: the exported step)."""
    step: int | None = None
    """Export this step (CKPT/step_NNNNNNNN) instead of the latest."""
    merge_lora: bool = False
    """LoRA checkpoints: write the base model with the adapters merged in (W + alpha/rank * B @ A)
    instead of a PEFT adapter (adapter_config.json + adapter_model.safetensors)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Cast floating-point weights to this dtype (default: as stored in the checkpoint)."""
    max_shard_mb: float = Field(default=4096, gt=0)
    """Largest safetensors file in MiB; bigger models are split into shards with an index."""
    base_model: str | None = None
    """PEFT adapters: base_model_name_or_path written to adapter_config.json (default: the
    checkpoint's base_checkpoint)."""
    fp8: bool = False
    """Write the weights that were FP8 in the Hugging Face checkpoint the step was converted from
    back as FP8: float8_e4m3fn values and weight_scale_inv in its blocks, under its
    quantization_config; a weight as converted comes back bit for bit, one changed since (LoRA
    merged into it) with fresh scales (default: every weight in full precision, as converted,
    and no quantization_config)."""

    @model_validator(mode="after")
    def _one_output(self) -> ExportConfig:
        if (self.out is None) == (self.megatron is None):
            raise ValueError("give one output: --out (a Hugging Face directory) or --megatron (a Megatron checkpoint)")
        if self.fp8 and self.megatron is not None:
            raise ValueError("--fp8 writes a Hugging Face directory (--out); a Megatron checkpoint holds full precision")
        return self

    def params(self) -> dict[str, Any]:
        """The parameters recorded in the manifest."""
        return self.model_dump(mode="json", exclude={"out"})


def output_info(info: TensorInfo, name: str, vocab_size: int, dtype: torch.dtype | None) -> TensorInfo:
    """Shape and dtype of a tensor as written: vocabulary padding dropped, cast applied."""
    shape = (vocab_size, *info.shape[1:]) if name.endswith(_VOCAB_ROWS) else info.shape
    return TensorInfo(shape, dtype if dtype is not None and info.dtype.is_floating_point else info.dtype)


def _finish(name: str, tensor: torch.Tensor, vocab_size: int, dtype: torch.dtype | None) -> torch.Tensor:
    """Drop the vocabulary padding and cast to the output dtype."""
    if name.endswith(_VOCAB_ROWS):
        tensor = tensor[:vocab_size]
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def write_weights(
    work: Path, weights: Source, vocab_size: int, config: ExportConfig, lora: Source | None = None,
    carried: Carried | None = None, fp8: Fp8Writer | None = None,
) -> torch.dtype:
    """The model's safetensors (with the adapters of ``lora`` merged in, and after them the
    ``carried`` tensors as stored; the weights ``fp8`` has scales for as FP8), each file written
    header first and then tensor by tensor, reading at most READ_BATCH_BYTES at a time. Returns
    the dtype of the written embedding."""
    carried = carried or Carried()
    dtype = _DTYPES[config.dtype] if config.dtype else None
    names = weight_names(weights)
    model = ModelConfig.from_hf(weights.meta.hf_config, source=str(weights.path))
    out_info = {n: output_info(weights.tensors[n], n, vocab_size, dtype) for n in names}
    if lora is not None:
        check_adapter_shapes(lora, weights, names, lora_modules(lora))
    load = merged_loader(lora, weights) if lora is not None else weights.load
    read_bytes = {n: weights.tensors[n].nbytes for n in names}
    # Each HF tensor: (our parameter, which of its parts: an expert of stacked experts, else 0).
    parts = {hf_name: (n, i) for n in names for i, hf_name in enumerate(hf_names(n, model))}

    def read(shard: list[str]) -> Iterator[torch.Tensor]:
        trained = [hf_name for hf_name in shard if hf_name in parts]  # the carried ones come after them
        wanted = list(dict.fromkeys(parts[hf_name][0] for hf_name in trained))
        for batch in plan_shards(wanted, read_bytes, READ_BATCH_BYTES):
            finished = {n: split_experts(n, _finish(n, t, vocab_size, dtype)) for n, t in load(batch).items()}
            yield from (finished[parts[hf_name][0]][parts[hf_name][1]].contiguous() for hf_name in trained
                        if parts[hf_name][0] in finished)
        yield from carried.read(shard[len(trained):])

    specs = {}
    for n in names:
        info = out_info[n]
        shape = info.shape[1:] if is_stacked_experts(n) else info.shape
        specs |= {hf_name: (info.dtype, shape) for hf_name in hf_names(n, model)}
    specs |= carried.specs()
    if fp8 is not None:
        specs, read = fp8.specs(specs), fp8.reader(read)
    write_hf_weights(work, specs, int(config.max_shard_mb * 2**20), read)
    return out_info[TIED_INPUT].dtype


def hf_config(meta: CheckpointMeta, dtype: torch.dtype, fp8: bool = False) -> dict[str, Any]:
    """config.json: the original, with the dtype the weights were written in; its
    quantization_config only for an FP8 export."""
    config = dict(meta.hf_config)
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    if not fp8:
        config.pop(QUANTIZATION_CONFIG, None)
    return config


def fp8_writer(source: Source, weights: Source, carried: Carried) -> Fp8Writer:
    """What ``--fp8`` writes as FP8: the weights whose scales convert recorded in the step
    directory ``weights`` (a Hugging Face directory, a LoRA checkpoint's base: its own scales)."""
    where = str(source.path / META)
    scheme = read_quantization(source.meta.hf_config, where)
    if not isinstance(scheme, Fp8Blocks):
        raise CheckpointError(f"{where}: --fp8 writes back the FP8 weights of a model converted from an FP8 "
                              f"checkpoint; its {QUANTIZATION_CONFIG} is {source.meta.hf_config.get(QUANTIZATION_CONFIG)}")
    if weights.hf_files is not None:
        recorded = fp8_scales([*(part for parts in weights.hf_files.values() for part in parts),
                               *carried.tensors.items()])
    else:
        recorded = read_fp8_scales(weights.path)
    if not recorded:
        raise CheckpointError(f"{weights.path}: no FP8 scales recorded ({FP8_SCALES}); --fp8 exports the step "
                              "directory convert wrote from an FP8 checkpoint storing each FP8 weight as one tensor "
                              "(fused experts are written one tensor per expert), or a LoRA checkpoint on it")
    return Fp8Writer(scheme, recorded, dequantized_dtype(source.meta.hf_config, where))


def write_peft_adapter(work: Path, lora: Source, vocab_size: int, config: ExportConfig) -> None:
    """adapter_model.safetensors and adapter_config.json in PEFT's layout."""
    modules = lora_modules(lora)
    if any(m.endswith("embed_tokens") for m in modules):
        raise CheckpointError(f"{lora.path}: PEFT export of embed_tokens adapters is not supported; use merge_lora")
    dtype = _DTYPES[config.dtype] if config.dtype else None
    tensors = lora.load([m + s for m in modules for s in (LORA_A, LORA_B)])
    model = ModelConfig.from_hf(lora.meta.hf_config, source=str(lora.path))
    targets = expert_targets(modules)
    out = {}
    for name, tensor in tensors.items():
        if is_expert_adapter(name):
            key, value = peft_expert_tensor(name, tensor, targets)
        else:
            key, value = hf_names(name, model)[0], tensor
        out[PEFT_PREFIX + key] = _finish(name, value, vocab_size, dtype)
    write_safetensors(work / ADAPTER_WEIGHTS, {n: (t.dtype, tuple(t.shape)) for n, t in out.items()}, out.values())
    lora_config = lora.meta.lora or {}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.base_model or lora.meta.base_checkpoint,
        "r": lora_config["rank"],
        "lora_alpha": lora_config["alpha"],
        "lora_dropout": lora_config.get("dropout", 0.0),
        "target_modules": sorted({m.rpartition(".")[2] for m in modules if not is_expert_adapter(m)}),
        "target_parameters": [f"experts.{t}" for t in targets] or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (work / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2))


def copy_tokenizer(work: Path, sources: list[Source]) -> Path | None:
    """Copy the tokenizer files of the first source that has a tokenizer; returns where from."""
    for source in sources:
        directory = source.tokenizer_dir
        if directory.is_dir() and any(directory.glob("tokenizer*")):
            copy_tokenizer_files(directory, work)
            return directory
    log.warning("no tokenizer beside %s: the export has no tokenizer files", sources[0].path)
    return None


def export_megatron(config: ExportConfig, source: Source) -> Path:
    """The checkpoint as a Megatron checkpoint root in ``config.megatron`` (a LoRA checkpoint's
    base with its adapters merged in)."""
    weights, load = source, source.load
    if source.meta.lora is not None:
        if not config.merge_lora:
            raise CheckpointError(f"{source.path}: a LoRA checkpoint; a Megatron checkpoint holds whole weights, so "
                                  "export it with --merge-lora")
        weights = base_source(source)
        load = merged_loader(source, weights)
    model_config = ModelConfig.from_hf(weights.meta.hf_config, source=str(weights.path))
    names = weight_names(weights)
    if source.meta.lora is not None:
        check_adapter_shapes(source, weights, names, lora_modules(source))
    out = config.megatron
    assert out is not None
    check_replaceable(out, STAGE)
    iteration = config.iteration if config.iteration is not None else source.meta.step
    # One dtype for every tensor: the asked one, else the embedding's as stored.
    dtype = _DTYPES[config.dtype] if config.dtype else weights.tensors[TIED_INPUT].dtype
    legacy = config.megatron_format == "legacy"
    spec = config.megatron_spec or ("local" if legacy and not config.moe_grouped_gemm else "transformer_engine")
    layout = Layout(tp=config.tp, pp=config.pp, ep=config.ep, spec=spec, grouped=config.moe_grouped_gemm, legacy=legacy)
    check_layout(model_config, layout)
    with atomic_directory(out) as work:
        padded = write_megatron(work, model_config, load, layout, iteration, config.vocab_multiple, dtype)
        files = [file_record(p, work, with_hash=False) for p in sorted(work.rglob("*")) if p.is_file()]
        payload = manifest_payload(STAGE, config.params(), files, step_dir=str(source.path), step=source.meta.step,
                                   kind=f"megatron-{config.megatron_format}", iteration=iteration,
                                   padded_vocab_size=padded, base=str(weights.path) if weights is not source else None)
        write_json_atomic(work / MANIFEST, payload)
    return out


def export(config: ExportConfig) -> Path:
    """Run the stage; returns the output directory."""
    source = Source.checkpoint(resolve_step_dir(config.ckpt, config.step))
    if config.megatron is not None:
        return export_megatron(config, source)
    vocab_size = ModelConfig.from_hf(source.meta.hf_config, source=str(source.path / META)).vocab_size
    lora = source if source.meta.lora is not None else None
    if lora is not None:  # a malformed LoRA checkpoint fails before anything is written
        lora_scale(lora)
        lora_modules(lora)
    weights = base_source(lora) if lora is not None and config.merge_lora else source
    carried = untrained_tensors(weights.path) if lora is None or config.merge_lora else Carried()
    if config.fp8 and lora is not None and not config.merge_lora:
        raise CheckpointError(f"{source.path}: a LoRA checkpoint; --fp8 writes whole weights, so export it with "
                              "--merge-lora")
    fp8 = fp8_writer(source, weights, carried) if config.fp8 else None
    check_replaceable(config.out, STAGE)
    with atomic_directory(config.out) as work:
        if lora is not None and not config.merge_lora:
            write_peft_adapter(work, lora, vocab_size, config)
            kind = "peft_adapter"
        else:
            dtype = write_weights(work, weights, vocab_size, config, lora, carried, fp8)
            (work / "config.json").write_text(json.dumps(hf_config(source.meta, dtype, fp8 is not None), indent=2))
            kind = "merged" if lora is not None else "model"
        tokenizer = copy_tokenizer(work, [source, weights])
        files = [file_record(p, work, with_hash=False) for p in sorted(work.rglob("*")) if p.is_file()]
        payload = manifest_payload(
            STAGE, config.params(), files, step_dir=str(source.path), step=source.meta.step, kind=kind,
            base=str(weights.path) if weights is not source else None,
            tokenizer=str(tokenizer) if tokenizer else None, carried=carried.counts,
            **({"fp8": {"weights": len(fp8.written), "fresh_scales": fp8.fresh}} if fp8 is not None else {}),
        )
        write_json_atomic(work / MANIFEST, payload)
    return config.out


class ExportCommand(ExportConfig):
    """Export a training checkpoint (root or step directory) as a Hugging Face model directory
    that transformers loads (a LoRA checkpoint as a PEFT adapter or merged model), or with
    --megatron as a Megatron-LM / MindSpeed-LLM checkpoint (torch_dist or legacy) for --tp/--pp."""

    def cli_cmd(self) -> None:
        start = time.monotonic()
        out = export(ExportConfig(**self.model_dump()))
        size = sum(p.stat().st_size for p in out.rglob("*") if p.suffix in (".safetensors", ".distcp", ".pt"))
        print(f"{out}: {size / 1e9:.3f} GB of weights in {time.monotonic() - start:.1f} s")
