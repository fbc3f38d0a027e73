"""Hugging Face model directories: config.json and safetensors weights (one
``model.safetensors``, or shards listed by ``model.safetensors.index.json``), tensors named
as transformers names them (``hf_names.py``).

Loading builds the model on the meta device and fills it one tensor at a time straight
from the safetensors files, so the weights exist once in memory (plus one tensor in
flight), never as a random-initialised model and a state dict side by side.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from llmflow.models.config import ROPE_SHAPE_KEYS, ModelConfig, family_of
from llmflow.models.decoder import CausalLM
from llmflow.weights.errors import CheckpointError
from llmflow.weights.finite import check_finite
from llmflow.weights.hf_names import (
    TIED_INPUT,
    TIED_OUTPUT,
    checkpoint_tensors,
    fused_experts,
    hf_names,
    hf_to_ours,
    is_stacked_experts,
    left_out,
    split_experts,
)
from llmflow.weights.quantized import QUANTIZATION_CONFIG, dequantized_index
from llmflow.weights.safetensors_io import (
    StoredTensor,
    TensorSpecs,
    plan_shards,
    read_safetensors_header,
    read_tensor,
    slab,
    write_safetensors,
)

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

log = logging.getLogger(__name__)
def safetensors_files(directory: str | Path) -> list[Path]:
    """The weight files of an HF checkpoint directory, from its index when there is one."""
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that are not in {directory}: {absent}")
        return files
    single = directory / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise CheckpointError(
        f"{directory}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} (found: {found[:20]}); "
        "llmflow reads Hugging Face safetensors checkpoints"
    )


def iter_hf_tensors(directory: str | Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor of the checkpoint, one at a time."""
    for path in safetensors_files(directory):
        try:
            opened = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as error:  # a truncated or damaged file
            raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from error
        with opened as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys() but cannot be iterated
                yield path, name, f.get_tensor(name)


def index_hf_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of an HF checkpoint directory by HF name, from the file headers; a quantized
    tensor with its scales as the one dense tensor they encode (``quantized.py``)."""
    tensors: dict[str, StoredTensor] = {}
    for path in safetensors_files(directory):
        tensors.update(read_safetensors_header(path))
    return dequantized_index(directory, tensors)


StoredParts = list[tuple[str, StoredTensor]]
"""The checkpoint tensors one of our parameters is read from, by HF name: one, or one per
expert (in expert order) of a stacked expert projection. An expert of fused experts is the
slab of the fused tensor that holds it, named ``{fused}[{expert}]`` or
``{fused}[{expert}, {start}:{stop}]`` (its rows along dim 1)."""


def _fused_parts(hf_name: str, stored: StoredTensor, ours: list[str],
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[str, StoredTensor]]]:
    """The per-expert parts of the fused expert tensor ``hf_name`` (``fused_experts``: our
    stacked projections ``ours`` side by side along its dim 1), each the contiguous byte range
    of the file that holds it: read as any stored tensor, alone, bit for bit."""
    if any(name not in shapes for name in ours):
        raise CheckpointError(f"{stored.path}: tensor {hf_name!r} has no place in the model")
    experts, *each = shapes[ours[0]]
    rows = [shapes[name][1] for name in ours]
    expected = (experts, sum(rows), *each[1:])
    if stored.shape != expected:
        raise CheckpointError(f"{stored.path}: tensor {hf_name!r} has shape {stored.shape}, config.json implies "
                              f"{expected} (experts fused along dim 0)")
    parts: dict[str, list[tuple[str, StoredTensor]]] = {}
    start = 0
    for name, count in zip(ours, rows, strict=True):
        cut = f", {start}:{start + count}" if len(ours) > 1 else ""
        parts[name] = [(f"{hf_name}[{e}{cut}]", slab(stored, e, start, start + count)) for e in range(experts)]
        start += count
    return parts


def stored_parameters(directory: Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                      hf_tensors: dict[str, StoredTensor] | None = None) -> dict[str, StoredParts]:
    """For each of our parameters in ``shapes`` (the shape the checkpoint stores it at), the
    tensors of the HF checkpoint in ``directory`` it is read from; a tied output projection
    reads the embedding. Checked before anything is read: a tensor with no place in the model,
    a shape config.json does not imply, or a missing tensor is a ``CheckpointError`` naming it."""
    hf_tensors = index_hf_tensors(directory) if hf_tensors is None else hf_tensors
    found: dict[str, dict[int, tuple[str, StoredTensor]]] = {}
    fused_from: dict[str, str] = {}  # our stacked projection -> the fused tensor it is read from
    per_expert: set[str] = set()  # our stacked projections read from one tensor per expert
    unknown = []
    for hf_name, stored in hf_tensors.items():
        fused = fused_experts(hf_name, config)
        if fused is not None:
            for name, parts in _fused_parts(hf_name, stored, fused, shapes).items():
                fused_from[name] = hf_name
                found.setdefault(name, {}).update(enumerate(parts))
            continue
        mapped = hf_to_ours(hf_name, config)
        if mapped is None:
            continue
        name, expert = mapped
        if name not in shapes or (expert is not None and expert >= shapes[name][0]):
            unknown.append(hf_name)
            continue
        if expert is not None:
            per_expert.add(name)
        found.setdefault(name, {})[expert or 0] = (hf_name, stored)
    twice = sorted(per_expert & set(fused_from))
    if twice:
        raise CheckpointError(f"{directory}: the experts of {twice[0]!r} are stored both fused "
                              f"({fused_from[twice[0]]!r}) and one tensor per expert")
    if unknown:
        experts = f" of num_experts={config.num_experts}" if config.num_experts else ""
        raise CheckpointError(f"{hf_tensors[unknown[0]].path}: tensor {unknown[0]!r} has no place in a "
                              f"{config.model_type} model{experts} ({len(unknown)} such tensors)")
    sources: dict[str, StoredParts] = {}
    missing = []
    for name, shape in shapes.items():
        source = TIED_INPUT if config.tie_word_embeddings and name == TIED_OUTPUT else name
        each = tuple(shape[1:]) if is_stacked_experts(name) else tuple(shape)
        parts = found.get(source, {})
        sources[name] = []
        for i, hf_name in enumerate(hf_names(source, config)):
            if i not in parts:
                missing.append(hf_name)
                continue
            stored = parts[i][1]
            if stored.shape != each:
                raise CheckpointError(f"{stored.path}: tensor {hf_name!r} has shape {stored.shape}, "
                                      f"config.json implies {each}")
            sources[name].append(parts[i])
    if missing:
        raise CheckpointError(f"{directory}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    return sources


def read_parameter(name: str, parts: StoredParts, rows: int | None = None) -> torch.Tensor:
    """Our parameter ``name`` from its stored parts (``stored_parameters``), each checked for
    NaN/Inf as it is read; ``rows``: pad dim 0 with zeros to this many rows."""
    tensors = []
    for hf_name, stored in parts:
        tensor = read_tensor(stored, rows)
        check_finite(tensor, stored.path, hf_name)
        tensors.append(tensor)
    return torch.stack(tensors) if is_stacked_experts(name) else tensors[0]


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Our parameter, or persistent buffer, ``name`` set to ``value``."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    if leaf in module._buffers:
        module._buffers[leaf] = value
        return
    module._parameters[leaf] = nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)


def load_hf_weights(
    model: CausalLM, directory: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> None:
    """Fill ``model`` (typically on the meta device) from the HF checkpoint in ``directory``,
    one parameter at a time (a stacked expert projection from its experts' tensors), every
    tensor checked against config.json before any is read (``stored_parameters``). The tensors
    the decoder does not hold (a vision tower: ``Family.hf_left_out``) are left out, said in
    one line; convert and training carry them instead (``carried.py``)."""
    config = model.config
    tensors = checkpoint_tensors(model)
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    hf_tensors = index_hf_tensors(Path(directory))
    report = left_out(list(hf_tensors), config)
    if report is not None:
        log.warning("%s: %s; llmflow builds the %s text model", directory, report, config.model_type)
    for name, parts in stored_parameters(Path(directory), config, shapes, hf_tensors).items():
        kept = dtype if isinstance(tensors[name], nn.Parameter) else tensors[name].dtype  # a buffer keeps its dtype
        _set_parameter(model, name, read_parameter(name, parts).to(device=device, dtype=kept))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.reset_rope(device)


def load_hf_model(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """The decoder with the weights of the HF checkpoint in ``directory``."""
    config = ModelConfig.from_file(directory)
    with torch.device("meta"):
        model = CausalLM(config)
    load_hf_weights(model, directory, dtype, device)
    return model


def hf_config_dict(config: ModelConfig) -> dict:
    """config.json for ``config``: the original keys, updated with the current shape.
    Rope and dtype are written in the spelling the original used (transformers 4 style
    when there was none), which transformers 4 and 5 both read. A multimodal config keeps its
    other towers' keys: the decoder's are written into its nested text config."""
    family = family_of(config.model_type)
    hf = dict(config.hf_config)
    hf.pop(QUANTIZATION_CONFIG, None)  # the weights written are full precision
    nested = family.text_config_key
    text = dict(hf.get(nested) or {}) if nested else hf
    shape = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        # SwiGLU's key; a GeGLU is written by its family as transformers reads it (Gemma's hidden_activation)
        **({"hidden_act": "silu"} if config.hidden_act == "silu" else {}),
    }
    if "intermediate_size" not in text and not config.intermediate_size:  # every layer routes (Qwen3.5-MoE)
        del shape["intermediate_size"]
    text.update(shape)
    # Where transformers reads them: a multimodal model ties by its top-level key.
    (hf if nested else text)["tie_word_embeddings"] = config.tie_word_embeddings
    for key in ("bos_token_id", "eos_token_id"):
        (hf if nested and text.get(key) is None and hf.get(key) is not None else text)[key] = getattr(config, key)
    text.update(family.write_options(config))
    params = text.get("rope_parameters")
    kept = {k: v for k, v in params.items() if k in ROPE_SHAPE_KEYS} if isinstance(params, dict) else {}
    if "partial_rotary_factor" in kept:
        kept["partial_rotary_factor"] = config.partial_rotary_factor
    elif "partial_rotary_factor" in text:
        text["partial_rotary_factor"] = config.partial_rotary_factor
    if "rope_parameters" in text:
        rope = {"rope_type": "default", **(config.rope_scaling or {}), **kept, "rope_theta": config.rope_theta}
        per_layer_type = isinstance(params, dict) and isinstance(params.get("full_attention"), dict)
        text["rope_parameters"] = {**params, "full_attention": rope} if per_layer_type else rope
    else:
        text["rope_theta"] = config.rope_theta
        text["rope_scaling"] = config.rope_scaling
    if nested:
        hf[nested] = text
    hf.update(model_type=config.model_type, architectures=[family.architecture])
    hf["dtype" if "dtype" in hf else "torch_dtype"] = config.torch_dtype
    return hf


def save_hf_model(
    model: CausalLM, directory: str | Path, max_shard_bytes: int = 4 * 2**30, dtype: torch.dtype | None = None
) -> Path:
    """Write ``model`` as an HF checkpoint that transformers loads: config.json and
    safetensors (sharded with an index past ``max_shard_bytes``). The directory appears
    complete or not at all (written beside it, then renamed into place)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Made by mkdir (0o777 less the umask), not tempfile.mkdtemp (0700): the directory is renamed into place.
    tmp = directory.with_name(f".{directory.name}.tmp-{secrets.token_hex(6)}")
    tmp.mkdir()
    try:
        tensors = {}
        for name, param in checkpoint_tensors(model).items():
            if model.config.tie_word_embeddings and name == TIED_OUTPUT:
                continue
            cast = dtype if dtype is not None and isinstance(param, nn.Parameter) else param.dtype
            value = param.detach().to(cast).cpu()
            for hf_name, part in zip(hf_names(name, model.config), split_experts(name, value), strict=True):
                tensors[hf_name] = part.contiguous()
        specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        write_hf_weights(tmp, specs, max_shard_bytes, lambda names: (tensors[n] for n in names))
        config = hf_config_dict(model.config)
        if dtype is not None:
            config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def write_hf_weights(directory: Path, specs: TensorSpecs, max_shard_bytes: int,
                     read: Callable[[list[str]], Iterable[torch.Tensor]]) -> None:
    """A model's weights in ``directory`` as transformers lays them out: model.safetensors, or
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (a bigger tensor
    alone) and model.safetensors.index.json. ``read(names)`` yields the tensors of one shard,
    in order."""
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in specs.items()}
    shards = plan_shards(list(specs), sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = SAFETENSORS_SINGLE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / fname, {name: specs[name] for name in shard}, read(shard))
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
