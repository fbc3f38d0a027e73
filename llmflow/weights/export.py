"""The export stage: a training checkpoint (``training_checkpoint.py``) -> a Hugging Face model
directory (or, with ``megatron``, a Megatron-LM / MindSpeed-LLM checkpoint: ``megatron/exporter.py``).

Any step directory exports, whatever layout it was saved under: DCP reshards while one
process reads the model tensors (and only those: optimizer state is never read). The
output is safetensors (sharded with an index past ``max_shard_mb``), the original
config.json (vocabulary padding removed) and the tokenizer files, which transformers
loads. Each safetensors file is written header first and then tensor by tensor, so memory
stays near READ_BATCH_BYTES (or the largest tensor), whatever the model's size.

A LoRA checkpoint (meta.lora set) holds only adapters. With ``merge_lora`` the base
weights (meta.base_checkpoint: a checkpoint, or the Hugging Face directory training
started from) are written with ``W + alpha / rank * B @ A`` merged into every adapted
weight; without it the adapters are written in PEFT's layout (adapter_config.json +
adapter_model.safetensors).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.models.config import ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.weights.dcp import dcp_load
from llmflow.weights.errors import CheckpointError
from llmflow.weights.hf import index_hf_tensors, write_hf_weights
from llmflow.weights.hf_names import TIED_INPUT, TIED_OUTPUT, expected_names, ours_to_hf
from llmflow.weights.megatron.exporter import write_megatron
from llmflow.weights.safetensors_io import StoredTensor, plan_shards, read_tensor, write_safetensors
from llmflow.weights.stage_output import check_replaceable
from llmflow.weights.tokenizer_files import copy_tokenizer_files
from llmflow.weights.training_checkpoint import (
    META,
    MODEL_KEY,
    TOKENIZER_DIR,
    CheckpointMeta,
    lora_base,
    read_meta,
    resolve_step_dir,
    stored_tensors,
)

STAGE = "export"
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
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
    megatron_format: Literal["torch_dist", "legacy"] = "torch_dist"
    """Megatron: torch_dist (megatron-core's distributed checkpoint, resharded on load) or legacy
    (mp_rank_*/model_optim_rng.pt, Megatron-LM's --ckpt-format torch)."""
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

    @model_validator(mode="after")
    def _one_output(self) -> ExportConfig:
        if (self.out is None) == (self.megatron is None):
            raise ValueError("give one output: --out (a Hugging Face directory) or --megatron (a Megatron checkpoint)")
        return self

    def params(self) -> dict[str, Any]:
        """The parameters recorded in the manifest."""
        return self.model_dump(mode="json", exclude={"out"})


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Global shape and dtype of a stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Source:
    """What an export reads weights from: a checkpoint step directory, or (as the base of a
    LoRA checkpoint trained straight from one) a Hugging Face model directory."""

    path: Path
    meta: CheckpointMeta
    tensors: dict[str, TensorInfo]
    """Model tensors by name (``model.layers.0.self_attn.q_proj.weight``)."""
    hf_files: dict[str, StoredTensor] | None = None
    """Where each tensor lies, for a Hugging Face directory; None for a checkpoint."""

    @classmethod
    def checkpoint(cls, step_dir: Path) -> Source:
        stored = stored_tensors(step_dir)
        tensors = {n: TensorInfo(tuple(md.size), md.properties.dtype) for n, md in stored.items()}
        return cls(step_dir, read_meta(step_dir), tensors)

    @classmethod
    def hf_directory(cls, directory: Path) -> Source:
        config = ModelConfig.from_file(directory)
        files = index_hf_tensors(directory)
        tensors = {n: TensorInfo(t.shape, t.dtype) for n, t in files.items()}
        meta = CheckpointMeta(hf_config=config.hf_config, padded_vocab_size=config.vocab_size)
        return cls(directory, meta, tensors, files)

    @property
    def tokenizer_dir(self) -> Path:
        return self.path if self.hf_files is not None else self.path.parent / TOKENIZER_DIR

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full (unsharded) tensors ``names``; DCP reshards them from however they were saved."""
        if self.hf_files is not None:
            return {n: read_tensor(self.hf_files[n]) for n in names}
        state = {n: torch.empty(self.tensors[n].shape, dtype=self.tensors[n].dtype) for n in names}
        dcp_load({MODEL_KEY: state}, self.path, collective=False)
        return state


def weight_names(source: Source) -> list[str]:
    """The HF tensors of the model (a tied output projection appears once, as the
    embedding), checked against what the source stores."""
    config = ModelConfig.from_hf(source.meta.hf_config, source=str(source.path))
    with torch.device("meta"):
        model = CausalLM(config.padded_to(source.meta.padded_vocab_size))
    names = expected_names(model)
    missing = [n for n in names if n not in source.tensors]
    if missing:
        raise CheckpointError(f"{source.path}: lacks {len(missing)} model tensors, e.g. {missing[:5]}")
    for name in names:
        stored, expected = source.tensors[name].shape, tuple(model.get_parameter(name).shape)
        if stored != expected:
            raise CheckpointError(f"{source.path}: tensor {name!r} has shape {stored}, its config implies {expected}")
    return names


def lora_modules(source: Source) -> list[str]:
    """The adapted modules of a LoRA checkpoint (``model.layers.0.self_attn.q_proj``)."""
    others = sorted(n for n in source.tensors if not n.endswith((LORA_A, LORA_B)))
    if others:
        raise CheckpointError(f"{source.path}: LoRA checkpoint holds non-adapter tensors, e.g. {others[:5]}")
    modules = sorted({n.removesuffix(LORA_A).removesuffix(LORA_B) for n in source.tensors})
    unpaired = [m for m in modules if m + LORA_A not in source.tensors or m + LORA_B not in source.tensors]
    if unpaired:
        raise CheckpointError(f"{source.path}: adapters without both lora_A and lora_B: {unpaired[:5]}")
    if not modules:
        raise CheckpointError(f"{source.path}: LoRA checkpoint holds no adapter tensors")
    return modules


def lora_scale(source: Source) -> float:
    """alpha / rank of a LoRA checkpoint."""
    lora = source.meta.lora or {}
    if "rank" not in lora or "alpha" not in lora:
        raise CheckpointError(f"{source.path / META}: lora {lora} needs 'rank' and 'alpha'")
    return float(lora["alpha"]) / float(lora["rank"])


def base_source(lora: Source) -> Source:
    """The frozen base weights of a LoRA checkpoint: a checkpoint, or the Hugging Face
    directory it was trained from."""
    if not lora.meta.base_checkpoint:
        raise CheckpointError(f"{lora.path / META}: LoRA checkpoint names no base_checkpoint to merge into")
    path = lora_base(lora.path, lora.meta)
    base = Source.hf_directory(path) if (path / "config.json").is_file() else Source.checkpoint(resolve_step_dir(path))
    if base.meta.padded_vocab_size != lora.meta.padded_vocab_size:
        raise CheckpointError(
            f"{base.path}: base vocabulary of {base.meta.padded_vocab_size} rows differs from the LoRA "
            f"checkpoint's padded_vocab_size {lora.meta.padded_vocab_size} ({lora.path})"
        )
    return base


def check_adapter_shapes(lora: Source, weights: Source, names: list[str], modules: list[str]) -> None:
    """Every adapter belongs to a written weight W [out, in], with A [r, in] and B [out, r]."""
    for module in modules:
        a, b = lora.tensors[module + LORA_A].shape, lora.tensors[module + LORA_B].shape
        name = module + ".weight"
        weight = weights.tensors[name].shape if name in names else None
        if weight is None or len(a) != 2 or len(b) != 2 or a[0] != b[1] or (b[0], a[1]) != weight:
            raise CheckpointError(
                f"{lora.path}: adapter of {module} (A {a}, B {b}) does not fit a base weight "
                f"({'none written' if weight is None else weight}) in {weights.path}"
            )


def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> None:
    """``W += scale * B @ A`` (computed in float32) for every adapted weight in ``weights``."""
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        if module + LORA_A in adapters:
            a, b = adapters[module + LORA_A].float(), adapters[module + LORA_B].float()
            weights[name] = (weight.float() + scale * (b @ a)).to(weight.dtype)


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
    work: Path, weights: Source, vocab_size: int, config: ExportConfig, lora: Source | None = None
) -> torch.dtype:
    """The model's safetensors (with the adapters of ``lora`` merged in), each file written
    header first and then tensor by tensor, reading at most READ_BATCH_BYTES at a time.
    Returns the dtype of the written embedding."""
    dtype = _DTYPES[config.dtype] if config.dtype else None
    names = weight_names(weights)
    out_info = {n: output_info(weights.tensors[n], n, vocab_size, dtype) for n in names}
    modules = lora_modules(lora) if lora is not None else []
    if lora is not None:
        check_adapter_shapes(lora, weights, names, modules)
    scale = lora_scale(lora) if lora is not None else 0.0
    read_bytes = {n: weights.tensors[n].nbytes for n in names}
    ours = {ours_to_hf(n): n for n in names}

    def read(shard: list[str]) -> Iterator[torch.Tensor]:
        for batch in plan_shards([ours[name] for name in shard], read_bytes, READ_BATCH_BYTES):
            tensors = weights.load(batch)
            adapted = [m for m in modules if m + ".weight" in tensors]
            if adapted:
                merge_adapters(tensors, lora.load([m + s for m in adapted for s in (LORA_A, LORA_B)]), scale)
            yield from (_finish(name, tensors.pop(name), vocab_size, dtype) for name in batch)

    specs = {ours_to_hf(n): (out_info[n].dtype, out_info[n].shape) for n in names}
    write_hf_weights(work, specs, int(config.max_shard_mb * 2**20), read)
    return out_info[TIED_INPUT].dtype


def hf_config(meta: CheckpointMeta, dtype: torch.dtype) -> dict[str, Any]:
    """config.json: the original, with the dtype the weights were written in."""
    config = dict(meta.hf_config)
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


def write_peft_adapter(work: Path, lora: Source, vocab_size: int, config: ExportConfig) -> None:
    """adapter_model.safetensors and adapter_config.json in PEFT's layout."""
    modules = lora_modules(lora)
    if any(m.endswith("embed_tokens") for m in modules):
        raise CheckpointError(f"{lora.path}: PEFT export of embed_tokens adapters is not supported; use merge_lora")
    dtype = _DTYPES[config.dtype] if config.dtype else None
    tensors = lora.load([m + s for m in modules for s in (LORA_A, LORA_B)])
    out = {PEFT_PREFIX + ours_to_hf(n): _finish(n, t, vocab_size, dtype) for n, t in tensors.items()}
    write_safetensors(work / ADAPTER_WEIGHTS, {n: (t.dtype, tuple(t.shape)) for n, t in out.items()}, out.values())
    lora_config = lora.meta.lora or {}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.base_model or lora.meta.base_checkpoint,
        "r": lora_config["rank"],
        "lora_alpha": lora_config["alpha"],
        "lora_dropout": lora_config.get("dropout", 0.0),
        "target_modules": sorted({m.rpartition(".")[2] for m in modules}),
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


def merged_loader(lora: Source, weights: Source) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """Reads ``weights``' tensors by name with ``lora``'s adapters merged into each adapted one."""
    modules, scale = lora_modules(lora), lora_scale(lora)

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = weights.load(names)
        adapted = [m for m in modules if m + ".weight" in tensors]
        if adapted:
            merge_adapters(tensors, lora.load([m + s for m in adapted for s in (LORA_A, LORA_B)]), scale)
        return tensors

    return load


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
    with atomic_directory(out) as work:
        padded = write_megatron(work, model_config, load, config.tp, config.pp, iteration, config.vocab_multiple,
                                dtype, config.megatron_format == "legacy")
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
    check_replaceable(config.out, STAGE)
    with atomic_directory(config.out) as work:
        if lora is not None and not config.merge_lora:
            write_peft_adapter(work, lora, vocab_size, config)
            kind = "peft_adapter"
        else:
            dtype = write_weights(work, weights, vocab_size, config, lora)
            (work / "config.json").write_text(json.dumps(hf_config(source.meta, dtype), indent=2))
            kind = "merged" if lora is not None else "model"
        tokenizer = copy_tokenizer(work, [source, weights])
        files = [file_record(p, work, with_hash=False) for p in sorted(work.rglob("*")) if p.is_file()]
        payload = manifest_payload(
            STAGE, config.params(), files, step_dir=str(source.path), step=source.meta.step, kind=kind,
            base=str(weights.path) if weights is not source else None,
            tokenizer=str(tokenizer) if tokenizer else None,
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
