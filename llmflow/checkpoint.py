"""Training checkpoints: a root directory of DCP step directories and a ``latest`` pointer.

```
CKPT/
  latest                 name of the newest complete step directory ("step_00000100")
  step_00000100/         torch.distributed.checkpoint (DCP) output: .metadata + *.distcp
    meta.json            CheckpointMeta
    rng/rank_00000.pt    per-rank RNG states (optional)
  tokenizer/             the HF model's tokenizer files
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

import errno
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import MANIFEST, atomic_file, read_manifest, replace_directory, with_filename, write_json_atomic
from llmflow.models.hf_checkpoint import CheckpointError, all_finite

LATEST = "latest"
META = "meta.json"
RNG_DIR = "rng"
TOKENIZER_DIR = "tokenizer"
MODEL_KEY = "model"
DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d+)$")

# torch.distributed.checkpoint (and the DTensor it brings) is imported where it is used: it
# costs a second of start-up that commands loading a Hugging Face model never need.
if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import SavePlanner


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
    """Parallel layout the checkpoint was saved under (pipeline, data- and tensor-parallel
    sizes; checkpoints written before pipeline parallelism record no pp)."""
    lora: dict[str, Any] | None = None
    """The LoRA config (with at least ``rank`` and ``alpha``) when the checkpoint holds only
    adapter weights (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``); None for full weights."""
    base_checkpoint: str | None = None
    """LoRA checkpoints: where the frozen base weights are (a checkpoint root or step
    directory, or a Hugging Face model directory); a relative path is taken from this
    checkpoint's root."""
    contents: list[str] = Field(default_factory=lambda: [MODEL_KEY])
    """Top-level keys of the saved state, e.g. ["model"] or ["model", "optimizer", "scheduler", "train"]."""


def step_name(step: int) -> str:
    """Name of the step directory of ``step``: ``step_00000100``."""
    return f"step_{step:08d}"


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"padded_vocab_size: vocab_size={vocab_size}, multiple={multiple} must be >= 1")
    return -(-vocab_size // multiple) * multiple


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


def read_dcp_metadata(directory: Path) -> Metadata:
    """The DCP metadata of a step directory; CheckpointError naming the file when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            f"{directory / DCP_METADATA}: cannot read the checkpoint's metadata ({type(error).__name__}: {error}); "
            "the step directory is incomplete or damaged"
        ) from error


def check_dcp_files(directory: Path) -> None:
    """Refuse a DCP directory whose data files are missing or shorter than its metadata says
    (a copy cut short), naming the first such file, before anything is read."""
    needed: dict[str, int] = {}
    for info in read_dcp_metadata(directory).storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the checkpoint step directory is incomplete")
        if path.stat().st_size < size:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes where the checkpoint's metadata needs {size}; the file is truncated"
            )


def _unwrapped(error: CheckpointException, directory: Path) -> BaseException:
    """The error of the first failed rank when it is the user's (a file that cannot be read or
    written, a CheckpointError), else ``error`` itself: DCP wraps every failure in its own type."""
    failure = next(iter(error.failures.values()))[0]
    if isinstance(failure, OSError):
        return with_filename(failure, directory)
    if isinstance(failure, RuntimeError) and directory.exists() and os.statvfs(directory).f_bavail == 0:
        # torch.save's writer reports a write that hit a full disk as a RuntimeError without errno
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return failure if isinstance(failure, CheckpointError) else error


def check_replaceable(out: Path, stage: str) -> None:
    """Refuse to replace ``out`` unless it is absent, empty or an earlier output of ``stage``,
    so that a mistyped path never wipes a training checkpoint or a model."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is None or manifest.get("stage") != stage:
        raise CheckpointError(
            f"{out} exists and is not the output of an earlier 'llmflow {stage}' (no {MANIFEST} with "
            f"stage '{stage}'); remove it or choose another output directory"
        )


class NonFiniteError(RuntimeError):
    """Training produced NaN or ±Inf (a loss, a gradient norm, or a value about to be saved)."""


def named_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state dict (dicts and lists), by dotted path."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from named_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]], order: list[str] | None = None) -> str | None:
    """The first name, in ``order`` (every name any rank passes), whose tensor holds NaN or
    ±Inf on any rank, or None. Looks at each rank's own shards of DTensors. Under a process
    group it is a collective (one all-reduce agrees on the first); ranks may pass different
    names (pipeline stages), and without ``order`` the ranks' names are gathered, rank by rank."""
    from torch.distributed.tensor import DTensor

    names, flags = [], []
    for name, tensor in named:
        names.append(name)
        flags.append(all_finite(tensor.to_local() if isinstance(tensor, DTensor) else tensor))
    if order is None:
        order = names
        if _distributed():
            gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, names)
            order = list(dict.fromkeys(name for rank_names in gathered for name in rank_names))
    device = flags[0].device if flags else None
    finite = torch.stack(flags).tolist() if flags else []
    first = torch.tensor(min((order.index(n) for n, ok in zip(names, finite, strict=True) if not ok), default=len(order)),
                         device=device)
    if _distributed():
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    index = int(first)
    return order[index] if index < len(order) else None


def resume_note(root: str | Path) -> str:
    """Where a rerun of the run in ``root`` starts from, for an error message."""
    pointer = Path(root) / LATEST
    if pointer.is_file():
        return f"{pointer} still names {pointer.read_text().strip()}, where a rerun resumes"
    return f"no checkpoint is saved in {root}; a rerun starts from the beginning"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def dcp_save(state: dict[str, Any], directory: Path, writer: FileSystemWriter | None = None,
             planner: SavePlanner | None = None) -> None:
    """``dcp.save`` of ``state`` into ``directory``: collective under a process group, a
    plain local save without one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(state, storage_writer=writer or dcp.FileSystemWriter(str(directory)), planner=planner,
                     no_dist=not _distributed())
        except CheckpointException as error:
            raise _unwrapped(error, directory) from error


def dcp_load(state: dict[str, Any], directory: Path, collective: bool = True) -> None:
    """``dcp.load`` into ``state`` in place; collective under a process group unless
    ``collective`` is False (one process reading for itself)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_dcp_files(directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=not (collective and _distributed()))
        except CheckpointException as error:
            raise _unwrapped(error, directory) from error


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
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    dcp_save(state, tmp)
    if rng_state is not None:
        rng_path = tmp / RNG_DIR / f"rank_{_rank():05d}.pt"
        rng_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(rng_path) as f:
            torch.save(rng_state, f)
    _barrier()
    if _rank() == 0:
        meta = meta.model_copy(update={"step": step, "contents": list(state)})
        write_json_atomic(tmp / META, meta.model_dump(mode="json"))
        replace_directory(tmp, final)
        _write_latest(root, final.name)
        if keep is not None:
            _prune(root, keep, final.name)
    _barrier()
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


def load_rng_state(step_dir: str | Path, rank: int) -> dict[str, Any] | None:
    """The RNG states ``rank`` saved with the step; None when it saved none."""
    path = Path(step_dir) / RNG_DIR / f"rank_{rank:05d}.pt"
    if not path.is_file():
        return None
    return torch.load(path, weights_only=False)
