"""The convert stage: a Hugging Face model directory (or a Megatron-LM / MindSpeed-LLM
checkpoint of the same model) -> a training checkpoint (``training_checkpoint.py``).

The output root holds one step directory, ``step_00000000``, with the model's weights under
the DCP key "model", the vocabulary rows of the embedding (and untied output) matrix padded
with zeros to a multiple of ``pad_vocab_to_multiple``, the tokenizer files, ``latest`` and a
``manifest.json`` written last; a model with tensors the decoder does not hold (a vision
tower, multi-token prediction layers) has them beside it in ``carried/``, bit for bit
(``carried.py``). The padding is the model's, recorded in the checkpoint: the
embedding and output projection stay whole on every tensor-parallel rank, so one checkpoint
trains, generates and evaluates at any tensor-parallel degree.

Conversion streams: the safetensors files are read with plain file reads, one tensor at a
time, straight into the DCP writer, one DCP file per tensor. Peak memory is about the
largest tensor, whatever the model's size. A Megatron checkpoint (``--megatron``, read by
``megatron/``) streams the same way, one layer of one Megatron tensor at a time; the
Hugging Face directory then gives only the config.json and tokenizer of the model it holds.
A quantized checkpoint (block-scaled FP8, MXFP4: ``quantized.py``) is dequantized as it
streams; the scales of its FP8 weights are kept as stored in the step directory's
``fp8_scales.safetensors``, for ``export --fp8``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from llmflow.artifacts import (
    MANIFEST,
    atomic_directory,
    file_record,
    manifest_payload,
    read_manifest,
    write_json_atomic,
)
from llmflow.models.config import ModelConfig
from llmflow.models.decoder import CausalLM
from llmflow.weights.carried import CARRIED_DIR, Carried, carried_tensors, write_carried
from llmflow.weights.dcp import dcp_save
from llmflow.weights.errors import CheckpointError
from llmflow.weights.finite import check_finite
from llmflow.weights.hf import StoredParts, index_hf_tensors, read_parameter, stored_parameters
from llmflow.weights.hf_names import TIED_INPUT, TIED_OUTPUT, is_stacked_experts
from llmflow.weights.megatron.importer import Planned, check_supported, plan_import
from llmflow.weights.megatron.reader import open_checkpoint
from llmflow.weights.quantized import fp8_scales, write_fp8_scales
from llmflow.weights.safetensors_io import StoredTensor
from llmflow.weights.stage_output import check_replaceable
from llmflow.weights.tokenizer_files import copy_tokenizer_files
from llmflow.weights.training_checkpoint import (
    LATEST,
    META,
    MODEL_KEY,
    TOKENIZER_DIR,
    CheckpointMeta,
    padded_vocab_size,
    step_name,
)

STAGE = "convert"
# Megatron's default for --make-vocab-size-divisible-by.
DEFAULT_VOCAB_MULTIPLE = 128
VOCAB_PARAMS = (TIED_INPUT, TIED_OUTPUT)


class ConvertConfig(BaseModel):
    """Convert a Hugging Face model directory into a training checkpoint."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    hf: Path
    """Hugging Face model directory: config.json, safetensors weights (one file or sharded
    with model.safetensors.index.json) and tokenizer files. With --megatron, only its
    config.json and tokenizer are read: the model the Megatron checkpoint holds."""
    megatron: Path | None = None
    """Read the weights from this Megatron-LM / MindSpeed-LLM checkpoint instead: a root with
    latest_checkpointed_iteration.txt, or one iteration directory, in megatron-core's torch_dist
    format or the legacy per-rank layout (mp_rank_*/model_optim_rng.pt), saved at any tensor and
    pipeline parallel sizes. Optimizer and RNG state are not read."""
    out: Path
    """Checkpoint root to write (latest, step_00000000/, tokenizer/, manifest.json)."""
    pad_vocab_to_multiple: int = Field(default=DEFAULT_VOCAB_MULTIPLE, ge=1)
    """Pad the vocabulary rows to a multiple of this (Megatron's make-vocab-size-divisible-by);
    1 turns padding off. The checkpoint then trains at any tensor-parallel degree."""
    init: Literal["weights", "random"] = "weights"
    """weights: the directory's weights; random: only its config.json and tokenizer, with
    freshly initialised weights (pretraining from scratch; no safetensors needed)."""
    seed: int = 0
    """Seed of the random initialisation (init=random)."""

    def params(self) -> dict[str, Any]:
        """The parameters recorded in the manifest."""
        params = {"hf": str(self.hf), "pad_vocab_to_multiple": self.pad_vocab_to_multiple}
        params |= {"megatron": str(self.megatron)} if self.megatron is not None else {}
        return params | ({"init": self.init, "seed": self.seed} if self.init == "random" else {})


def plan_sources(
    hf_dir: Path, model_config: ModelConfig, hf_tensors: dict[str, StoredTensor], padded: int
) -> dict[str, StoredParts]:
    """For each key of the checkpoint's model state (``CausalLM.state_dict()`` of the padded
    model), the HF tensors it is read from; checks names and shapes before anything is written."""
    with torch.device("meta"):
        model = CausalLM(model_config.padded_to(padded))
    shapes = {name: (model_config.vocab_size, *t.shape[1:]) if name in VOCAB_PARAMS else tuple(t.shape)
              for name, t in model.state_dict().items()}
    return stored_parameters(hf_dir, model_config, shapes, hf_tensors)


class StreamingSavePlanner(DefaultSavePlanner):
    """Plans from a state dict of meta tensors (shapes only) and reads each tensor only when
    the writer asks for it."""

    def __init__(self, read: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._read = read

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._read(write_item.index.fqn)


def write_streamed_state(step_dir: Path, meta_state: dict[str, torch.Tensor],
                         read: Callable[[str], torch.Tensor]) -> None:
    """The DCP directory of the model state whose shapes and dtypes ``meta_state`` gives (meta
    tensors), each tensor read by ``read(name)`` only when the writer comes to it."""

    def read_fqn(fqn: str) -> torch.Tensor:
        return read(fqn.removeprefix(f"{MODEL_KEY}."))

    # One file per tensor: the writer keeps every tensor of a file alive until the file is done.
    writer = FileSystemWriter(str(step_dir), single_file_per_rank=False)
    try:
        dcp_save({MODEL_KEY: meta_state}, step_dir, writer=writer, planner=StreamingSavePlanner(read_fqn))
    except CheckpointException as error:  # DCP wraps what read() raised: report that, in one line
        refused = [e for e, _ in error.failures.values() if isinstance(e, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def write_model_state(step_dir: Path, sources: dict[str, StoredParts], padded: int) -> None:
    """The DCP directory of the model state, read tensor by tensor from the HF files (the
    experts of a stacked projection together)."""
    meta_state = {}
    for name, parts in sources.items():
        shape = parts[0][1].shape
        if name in VOCAB_PARAMS:
            shape = (padded, *shape[1:])
        elif is_stacked_experts(name):
            shape = (len(parts), *shape)
        meta_state[name] = torch.empty(shape, dtype=parts[0][1].dtype, device="meta")

    def read(name: str) -> torch.Tensor:  # as it streams: each tensor is read once
        return read_parameter(name, sources[name], padded if name in VOCAB_PARAMS else None)

    write_streamed_state(step_dir, meta_state, read)


def write_megatron_state(step_dir: Path, plan: dict[str, Planned], source: Path) -> None:
    """The DCP directory of the model state, read layer by layer from a Megatron checkpoint."""
    meta_state = {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in plan.items()}

    def read(name: str) -> torch.Tensor:
        tensor = plan[name].read()
        check_finite(tensor, source, name)
        return tensor

    write_streamed_state(step_dir, meta_state, read)


def write_random_state(step_dir: Path, config: ModelConfig, padded_vocab: int, seed: int) -> None:
    """A freshly initialised model of ``config`` (vocabulary padded with zero rows) as the step's weights."""
    model = CausalLM(config.padded_to(padded_vocab))
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # padding rows are zero, as when converting weights
        model.model.embed_tokens.weight[config.vocab_size:] = 0
        model.lm_head.weight[config.vocab_size:] = 0
    dcp_save({MODEL_KEY: model.state_dict()}, step_dir)


def convert(config: ConvertConfig) -> Path:
    """Run the stage; returns the checkpoint root."""
    hf_dir = config.hf
    if not hf_dir.is_dir():
        raise CheckpointError(f"--hf {hf_dir}: not a directory")
    model_config = ModelConfig.from_file(hf_dir)
    padded = padded_vocab_size(model_config.vocab_size, config.pad_vocab_to_multiple)
    carried = Carried()
    if config.megatron is not None:
        if config.init != "weights":
            raise ValueError("--megatron reads the checkpoint's weights: init must be 'weights'")
        megatron = open_checkpoint(config.megatron)
        check_supported(megatron, model_config, f"{hf_dir / 'config.json'}")
        megatron_plan = plan_import(megatron, model_config, padded)
    elif config.init == "weights":
        hf_tensors = index_hf_tensors(hf_dir)
        sources = plan_sources(hf_dir, model_config, hf_tensors, padded)
        carried = carried_tensors(hf_tensors, model_config)
        scales = fp8_scales([*(part for parts in sources.values() for part in parts), *carried.tensors.items()])
    check_replaceable(config.out, STAGE)
    meta = CheckpointMeta(hf_config=model_config.hf_config, padded_vocab_size=padded, carried=carried.counts)
    with atomic_directory(config.out) as work:
        step_dir = work / step_name(0)
        if config.megatron is not None:
            write_megatron_state(step_dir, megatron_plan, megatron.directory)
        elif config.init == "weights":
            write_model_state(step_dir, sources, padded)
            if scales:
                write_fp8_scales(step_dir, scales)
        else:
            write_random_state(step_dir, model_config, padded, config.seed)
        if carried.tensors:
            write_carried(work / CARRIED_DIR, carried)
        write_json_atomic(step_dir / META, meta.model_dump(mode="json"))
        copy_tokenizer_files(hf_dir, work / TOKENIZER_DIR)
        (work / LATEST).write_text(step_dir.name + "\n")
        files = [file_record(p, work, with_hash=False) for p in sorted(work.rglob("*")) if p.is_file()]
        payload = manifest_payload(
            STAGE, config.params(), files, step_dir=step_dir.name, padded_vocab_size=padded,
            vocab_size=model_config.vocab_size, model_type=model_config.model_type, carried=carried.counts,
            **({"megatron": megatron.summary()} if config.megatron is not None else {}),
        )
        write_json_atomic(work / MANIFEST, payload)
    if carried.tensors:
        print(f"{carried.line()} (kept in {config.out / CARRIED_DIR})", flush=True)
    return config.out


class ConvertCommand(ConvertConfig):
    """Convert a Hugging Face model directory (config.json, safetensors, tokenizer), or with
    --megatron a Megatron-LM / MindSpeed-LLM checkpoint of that model, into a training
    checkpoint (DCP step directory, vocabulary padded for tensor parallelism)."""

    def cli_cmd(self) -> None:
        start = time.monotonic()
        out = convert(ConvertConfig(**self.model_dump()))
        if source := read_manifest(out).get("megatron"):
            print(f"read {source['format']} checkpoint {source['directory']} (iteration {source['iteration']}); "
                  f"not read: {', '.join(source['skipped']) or 'nothing (it holds the model only)'}")
        size = sum(p.stat().st_size for p in (out / step_name(0)).iterdir())
        elapsed = time.monotonic() - start
        print(f"{out}: {size / 1e9:.3f} GB of weights in {elapsed:.1f} s ({size / 1e9 / elapsed:.2f} GB/s)")
