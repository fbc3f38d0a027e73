"""Each training rank loads only its own shard of the model (as torchtitan does): the model is
built on the meta device, cut into pipeline stages and sharded there (``parallelize_decoder``
only records the layout), then given storage on the device (``to_empty``) and filled with this
rank's piece of every parameter straight from the weights on disk. No rank ever holds the whole
model: a rank holds its shards plus one tensor in flight.

- A Hugging Face directory: for each parameter this rank holds a piece of, the stored tensor's
  rows the piece covers are read (rows are contiguous in a safetensors file) and the columns
  it covers cut from them; of stacked experts only the experts the rank holds (expert
  parallelism and FSDP2 shard dim 0) are read. The tensors are found and checked against
  config.json by ``hf.stored_parameters``; NaN or ±Inf is refused naming the file and tensor,
  on every rank (the one whose shard holds it first, the others after hearing of it).
- A full-weight training checkpoint (DCP): DCP reads straight into the sharded (DTensor)
  parameters and reshards whatever layout the checkpoint was saved under.
- A LoRA checkpoint is not loaded here (``sharded_source`` gives None): its base is loaded
  whole and the adapters merged by ``loading.load_model``, as before.

LoRA adapters added on the meta device get the values the whole-model path gives them: every
adapter's full ``lora_A`` is drawn in turn from the same seeded generator (and the default
generator advanced as building the adapters on the device advanced it), then this rank's piece
copied.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmflow.models.config import ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.models.lora import ExpertLora, LoraLinear, init_lora_weights, is_lora_param
from llmflow.weights.errors import CheckpointError
from llmflow.weights.finite import check_finite
from llmflow.weights.hf import StoredParts, stored_parameters
from llmflow.weights.hf_names import checkpoint_tensors, is_stacked_experts
from llmflow.weights.process_group import distributed
from llmflow.weights.safetensors_io import StoredTensor, read_rows, read_tensor
from llmflow.weights.training_checkpoint import MODEL_KEY, is_checkpoint, load_checkpoint, read_meta, resolve_step_dir

_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
"""What activation checkpointing's wrapper adds to the names of a layer's parameters."""


@dataclasses.dataclass(frozen=True)
class ShardedSource:
    """Weights a training rank can load its shard of: a Hugging Face directory or the step
    directory of a full-weight training checkpoint."""

    path: Path
    config: ModelConfig
    """The model's config as ``load_model`` gives it (a checkpoint's padded vocabulary)."""
    hf_config: dict[str, Any]
    """config.json, with the original vocab_size."""
    checkpoint: bool


@dataclasses.dataclass
class LoadReport:
    """What one rank read from a Hugging Face directory (a DCP checkpoint's reads are DCP's)."""

    bytes_read: int = 0
    """Bytes of stored tensors read from the files (of a quantized tensor: its dequantized bytes)."""
    largest_read: int = 0
    """The most bytes read at once: the one piece of a tensor in flight."""


def sharded_source(path: str | Path) -> ShardedSource | None:
    """The weights in ``path`` (a Hugging Face directory, a checkpoint root or step directory)
    when a rank can load its shard of them; None for a LoRA checkpoint, whose base is loaded
    whole (``load_model``)."""
    path = Path(path)
    if is_checkpoint(path):
        step_dir = resolve_step_dir(path)
        meta = read_meta(step_dir)
        if meta.lora is not None:
            return None
        config = ModelConfig.from_hf(meta.hf_config).padded_to(meta.padded_vocab_size)
        return ShardedSource(step_dir, config, meta.hf_config, checkpoint=True)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {path}: neither a Hugging Face model directory (config.json) nor a checkpoint (latest)")
    return ShardedSource(path, ModelConfig.from_file(path), json.loads((path / "config.json").read_text()), checkpoint=False)


def meta_model(source: ShardedSource) -> CausalLM:
    """The model of ``source`` on the meta device: a layout, no storage."""
    with torch.device("meta"):
        return CausalLM(source.config)


@torch.no_grad()
def load_sharded(model: CausalLM, parts: list[CausalLM], source: ShardedSource, device: torch.device,
                 lora_seed: int | None = None) -> LoadReport:
    """Give ``parts`` (this rank's pipeline stages of ``model``, or ``[model]``; built on the
    meta device from ``meta_model(source)`` and already sharded by ``parallelize_decoder``)
    storage on ``device`` and fill each parameter's local shard from ``source``. LoRA adapters
    (``model`` adapted on the meta device) are initialised as ``apply_lora`` with
    ``torch.Generator(device).manual_seed(lora_seed)`` initialises them on a whole model.
    Collective under a process group when ``source`` is a checkpoint (DCP). Returns what this
    rank read from a Hugging Face directory."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    # Swapping keeps every Parameter object: FSDP2 keeps its references, tied weights stay tied.
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for part in parts:
            part.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for part in parts:
        part.model.reset_rope(device)
    params = _local_parameters(parts)
    report = LoadReport()
    refused = None
    try:
        if source.checkpoint:
            _load_checkpoint_shards(source.path, params)
        else:
            _load_hf_shards(source, params, report)
    except CheckpointError as error:
        refused = error
    _refuse_together(refused)
    if lora_seed is not None:
        _init_adapters(model, torch.Generator(device=device).manual_seed(lora_seed), device)
    return report


def _local_parameters(parts: list[CausalLM]) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by their name in the whole model (each
    once; adapters left out)."""
    params: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for part in parts:
        for name, param in checkpoint_tensors(part).items():
            name = name.replace(_CHECKPOINT_PREFIX, "")
            if id(param) not in seen and not is_lora_param(name):
                seen.add(id(param))
                params[name] = param
    return params


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's tensor of ``param``, its offset in the global tensor, its shape): a DTensor's
    local shard (FSDP2's unpadded one) and where it lies; a plain tensor's whole self."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.detach(), (0,) * param.ndim, tuple(param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"a shard of shape {tuple(local.shape)} where its placements {param.placements} "
                           f"give {tuple(shape)}")
    return local, tuple(offset), tuple(shape)


def _box(tensor: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...], first: int = 0) -> torch.Tensor:
    for dim in range(first, tensor.ndim):
        tensor = tensor.narrow(dim, offset[dim], shape[dim])
    return tensor


def _load_hf_shards(source: ShardedSource, params: dict[str, torch.Tensor], report: LoadReport) -> None:
    shapes = {name: tuple(t.shape) for name, t in checkpoint_tensors(meta_model(source)).items()}
    stored = stored_parameters(source.path, source.config, shapes)
    for name, param in params.items():
        local, offset, shape = local_box(param)
        if local.numel() == 0:
            continue
        parts: StoredParts = stored[name]
        if is_stacked_experts(name):  # [experts, out, in]: only the experts this rank holds
            for i in range(shape[0]):
                hf_name, tensor = parts[offset[0] + i]
                _copy_piece(local[i], hf_name, tensor, offset[1:], shape[1:], report)
        else:
            _copy_piece(local, *parts[0], offset, shape, report)


def _copy_piece(target: torch.Tensor, hf_name: str, stored: StoredTensor, offset: tuple[int, ...],
                shape: tuple[int, ...], report: LoadReport) -> None:
    """Read the rows of ``stored`` the box (``offset``, ``shape``) covers, cut its columns and
    copy it into ``target``."""
    piece = read_rows(stored, offset[0], offset[0] + shape[0]) if shape else read_tensor(stored)
    report.bytes_read += piece.nbytes
    report.largest_read = max(report.largest_read, piece.nbytes)
    piece = _box(piece, offset, shape, first=1)
    check_finite(piece, stored.path, hf_name)
    target.copy_(piece)


def _load_checkpoint_shards(step_dir: Path, params: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor

    state = {name: param.detach() for name, param in params.items()}
    load_checkpoint(step_dir, {MODEL_KEY: state})
    for name, tensor in state.items():
        check_finite(tensor.to_local() if isinstance(tensor, DTensor) else tensor, step_dir, f"{MODEL_KEY}.{name}")


def _refuse_together(error: CheckpointError | None) -> None:
    """Raise ``error`` on this rank, and on every other rank the first rank's refusal: a NaN
    lies in one rank's shard, and the others would otherwise wait for it at the first step."""
    messages = [str(error) if error is not None else None]
    if distributed():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, str(error) if error is not None else None)
    if error is not None:
        raise error
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _is_meta(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_meta


def _init_adapters(model: nn.Module, generator: torch.Generator, device: torch.device) -> None:
    """Every adapter of ``model`` (in module order, this rank's and the others') drawn as
    ``apply_lora`` draws it on a whole model on ``device`` (``init_lora_weights``: the full
    lora_A from ``generator``, this rank's piece kept)."""
    for module in model.modules():
        if not isinstance(module, LoraLinear):
            continue
        a = module.lora_A.weight
        # Building lora_A and lora_B on the device initialised them from the default generator.
        for features, out in ((module.in_features, a.shape[0]), (a.shape[0], module.out_features)):
            nn.Linear(features, out, bias=False, device=device, dtype=a.dtype)
        if _is_meta(a):  # a layer of another pipeline stage: drawn and dropped, so the later adapters get their values
            nn.init.kaiming_uniform_(torch.empty(a.shape, dtype=a.dtype, device=device), a=math.sqrt(5), generator=generator)
        else:
            init_lora_weights(module, generator)
    for module in model.modules():  # then the experts' adapters, rows of PEFT's [experts * r, in] each
        if not isinstance(module, ExpertLora):
            continue
        a = module.lora_A.weight
        if _is_meta(a):
            rows = torch.empty(a.shape, dtype=a.dtype, device=device).view(-1, a.shape[-1])
            nn.init.kaiming_uniform_(rows, a=math.sqrt(5), generator=generator)
        else:
            init_lora_weights(module, generator)
