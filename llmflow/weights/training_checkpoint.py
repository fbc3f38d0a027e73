"""Training checkpoints: a root directory of DCP step directories and a ``latest`` pointer.

```
CKPT/
  latest                 name of the newest complete step directory ("step_00000100")
  step_00000100/         torch.distributed.checkpoint (DCP) output: .metadata + *.distcp
    meta.json            CheckpointMeta
    rng/rank_00000.pt    per-rank RNG states (optional)
  tokenizer/             the HF model's tokenizer files
  carried/               tensors the decoder does not hold, kept untrained (optional, ``carried.py``)
```

The DCP state holds the model's parameters under the top-level key ``"model"`` (keys as
``CausalLM.state_dict()`` gives them, so DCP names look like
``model.model.layers.0.self_attn.q_proj.weight``), and optionally ``"optimizer"``,
``"scheduler"`` and ``"train"``. DCP reshards on load: a checkpoint saved under any
pipeline/data/tensor layout loads into any other, or into one process.

A step directory is written beside its final name, renamed into place once every rank has
finished, and only then named by ``latest`` (itself replaced by rename): a process killed
at any point leaves the previous ``latest`` and its step directory intact.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import atomic_file, replace_directory, write_json_atomic
from llmflow.weights.dcp import dcp_load, dcp_save, read_dcp_metadata
from llmflow.weights.errors import CheckpointError, NonFiniteError
from llmflow.weights.finite import check_finite, first_nonfinite, named_tensors
from llmflow.weights.process_group import barrier, global_rank

LATEST = "latest"
META = "meta.json"
RNG_DIR = "rng"
TOKENIZER_DIR = "tokenizer"
MODEL_KEY = "model"
_STEP_DIR = re.compile(r"^step_(\d+)$")

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata


class CheckpointMeta(BaseModel):
    """What a step directory holds besides the tensors: the model and how it was trained."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    hf_config: dict[str, Any]
    """The model's Hugging Face config.json, with its original (unpadded) vocab_size."""
    padded_vocab_size: int
    """Rows of the stored embedding and output matrices: vocab_size rounded up for tensor
    parallelism; the extra rows are zero at conversion and dropped at export."""
    step: int = 0
    """Optimizer steps taken when the checkpoint was saved."""
    consumed_samples: int = 0
    """Training samples consumed when the checkpoint was saved."""
    layout: dict[str, int] = Field(default_factory=lambda: {"pp": 1, "dp": 1, "tp": 1})
    """Parallel layout the checkpoint was saved under (pipeline, data-, context-, tensor- and
    expert-parallel sizes; an older checkpoint records no pp, cp or ep, which were 1)."""
    lora: dict[str, Any] | None = None
    """The LoRA config (with at least ``rank`` and ``alpha``) when the checkpoint holds only
    adapter weights (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``); None for full weights."""
    base_checkpoint: str | None = None
    """LoRA checkpoints: where the frozen base weights are (a checkpoint root or step
    directory, or a Hugging Face model directory); a relative path is taken from this
    checkpoint's root."""
    contents: list[str] = Field(default_factory=lambda: [MODEL_KEY])
    """Top-level keys of the saved state, e.g. ["model"] or ["model", "optimizer", "scheduler", "train"]."""
    carried: dict[str, int] = Field(default_factory=dict)
    """The original checkpoint's tensors the decoder does not hold (a vision tower, multi-token
    prediction layers), counted by name prefix (``{"model.visual.": 12}``): kept untrained in
    the checkpoint root's ``carried/`` and written back by export (``carried.py``)."""


def step_name(step: int) -> str:
    """Name of the step directory of ``step``: ``step_00000100``."""
    return f"step_{step:08d}"


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"padded_vocab_size: vocab_size={vocab_size}, multiple={multiple} must be >= 1")
    return -(-vocab_size // multiple) * multiple


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint root (``latest``) or a step directory (meta.json)."""
    return (path / LATEST).is_file() or (path / META).is_file()


def checkpoint_root(step_dir: Path) -> Path:
    """The checkpoint root a step directory belongs to."""
    return step_dir if (step_dir / LATEST).is_file() else step_dir.parent


def lora_base(step_dir: Path, meta: CheckpointMeta) -> Path:
    """Where a LoRA checkpoint's frozen base weights are (``meta.base_checkpoint``, a relative
    path taken from the checkpoint's root)."""
    if meta.base_checkpoint is None:
        raise CheckpointError(f"{step_dir}: a LoRA checkpoint without base_checkpoint")
    base = Path(meta.base_checkpoint)
    return base if base.is_absolute() else checkpoint_root(step_dir) / base


def latest_step_dir(root: str | Path) -> Path | None:
    """The step directory ``root/latest`` names; None when there is no ``latest`` yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    step_dir = Path(root) / name
    if not name or not (step_dir / META).is_file():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete step directory in {root}")
    return step_dir


def resolve_step_dir(path: str | Path, step: int | None = None) -> Path:
    """The step directory meant by ``path``: a step directory itself, or a checkpoint root
    (its ``latest`` step, or ``step`` when given)."""
    path = Path(path)
    if (path / META).is_file():
        if step is not None and path.name != step_name(step):
            raise CheckpointError(f"{path} is the step directory of another step than step={step} ({step_name(step)})")
        return path
    if step is not None:
        step_dir = path / step_name(step)
        if not (step_dir / META).is_file():
            raise CheckpointError(f"{path}: no complete step directory {step_name(step)} (no {step_dir / META})")
        return step_dir
    step_dir = latest_step_dir(path)
    if step_dir is None:
        what = "does not exist" if not path.exists() else f"has no '{LATEST}' file and no {META}"
        raise CheckpointError(f"{path} {what}: not an llmflow checkpoint root or step directory")
    return step_dir


def read_meta(step_dir: str | Path) -> CheckpointMeta:
    """The CheckpointMeta of a step directory."""
    path = Path(step_dir) / META
    if not path.is_file():
        raise CheckpointError(f"{step_dir}: no {META}; not a complete checkpoint step directory")
    return CheckpointMeta.model_validate_json(path.read_text())


def stored_tensors(step_dir: str | Path, key: str = MODEL_KEY) -> dict[str, TensorStorageMetadata]:
    """Global shape and dtype of every tensor stored under the top-level ``key`` of a step
    directory, by name within that key (``model.layers.0.self_attn.q_proj.weight``)."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    metadata = read_dcp_metadata(Path(step_dir))
    prefix = f"{key}."
    return {
        fqn.removeprefix(prefix): md
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, dcp_metadata.TensorStorageMetadata)
    }


def resume_note(root: str | Path) -> str:
    """Where a rerun of the run in ``root`` starts from, for an error message."""
    pointer = Path(root) / LATEST
    if pointer.is_file():
        return f"{pointer} still names {pointer.read_text().strip()}, where a rerun resumes"
    return f"no checkpoint is saved in {root}; a rerun starts from the beginning"


def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    meta: CheckpointMeta,
    keep: int | None = None,
    rng_state: dict[str, Any] | None = None,
) -> Path:
    """Save ``state`` as ``root/step_NNNNNNNN`` and point ``root/latest`` at it.

    Collective under a process group (every rank calls it with its shards); also works in a
    single process without one. ``meta.step`` and ``meta.contents`` are set from ``step``
    and the keys of ``state``. ``rng_state`` (each rank's own) goes to ``rng/rank_NNNNN.pt``.
    ``keep`` prunes all but the newest ``keep`` step directories (never the one ``latest``
    names). Returns the step directory.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1 (or None to keep every step)")
    root = Path(root)
    nonfinite = first_nonfinite(named_tensors(state))
    if nonfinite is not None:
        raise NonFiniteError(f"refusing to save step {step}: {nonfinite} holds NaN or Inf; {resume_note(root)}")
    final = root / step_name(step)
    # Every rank derives the same temporary path; rank 0 clears what a killed save left there.
    tmp = root / f".{final.name}.tmp"
    if global_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    dcp_save(state, tmp)
    if rng_state is not None:
        rng_path = tmp / RNG_DIR / f"rank_{global_rank():05d}.pt"
        rng_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(rng_path) as f:
            torch.save(rng_state, f)
    barrier()
    if global_rank() == 0:
        meta = meta.model_copy(update={"step": step, "contents": list(state)})
        write_json_atomic(tmp / META, meta.model_dump(mode="json"))
        replace_directory(tmp, final)
        _write_latest(root, final.name)
        if keep is not None:
            _prune(root, keep, final.name)
    barrier()
    return final


def _write_latest(root: Path, name: str) -> None:
    with atomic_file(root / LATEST, "w") as f:
        f.write(name + "\n")


def _prune(root: Path, keep: int, latest: str) -> None:
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    for _, path in steps[:-keep]:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(step_dir: str | Path, state: dict[str, Any]) -> CheckpointMeta:
    """Load the step directory into ``state`` in place, for whatever top-level keys ``state``
    has ("model" only, or "model", "optimizer", ...). Tensors may be plain, or DTensors
    under FSDP2 / tensor parallelism in any layout: DCP reshards. Collective under a process
    group. Returns the checkpoint's meta."""
    meta = read_meta(step_dir)
    absent = [key for key in state if key not in meta.contents]
    if absent:
        raise CheckpointError(f"{step_dir} holds {meta.contents}; it has no {absent}")
    dcp_load(state, Path(step_dir))
    return meta


def load_model_weights(step_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Load the model tensors of a step directory into ``state`` in place, refusing NaN or
    ±Inf (naming the step directory and the tensor)."""
    load_checkpoint(step_dir, {MODEL_KEY: state})
    for name, tensor in state.items():
        check_finite(tensor, step_dir, f"{MODEL_KEY}.{name}")


def optimizer_state_flattened(step_dir: Path) -> bool:
    """Whether the step's optimizer state is flattened (one entry per parameter); checkpoints
    written before that number their param_groups."""
    return "optimizer.param_groups.0.lr" not in read_dcp_metadata(step_dir).state_dict_metadata


def load_rng_state(step_dir: str | Path, rank: int) -> dict[str, Any] | None:
    """The RNG states ``rank`` saved with the step; None when it saved none."""
    path = Path(step_dir) / RNG_DIR / f"rank_{rank:05d}.pt"
    if not path.is_file():
        return None
    return torch.load(path, weights_only=False)
